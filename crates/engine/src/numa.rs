//! NUMA placement for the CPU tiers: which memory node each worker of the team runs on, and
//! which node holds each expert's bytes, so that an expert's products are computed by threads
//! of the node its weights sit on.
//!
//! On a host of one node (most VMs, one-socket machines) nothing here acts: the team and the
//! banks behave as they always did. On a host of several nodes (`/sys/devices/system/node`
//! lists several with CPUs this process may use):
//! - the team's workers are spread over the nodes (round robin, one per physical core) and
//!   each is kept on its node (on its core with `MOELANE_PIN=1`, else on the node's CPUs);
//! - expert `e` of a layer of `E` belongs to node `e * nodes / E` (contiguous blocks); it is
//!   built (read from the checkpoint, widened where it must be) by a thread whose memory
//!   policy prefers that node ([`load_expert`]: `set_mempolicy` around the load), so its
//!   pages are first touched there: nothing is copied twice and no mapping is split (binding
//!   each buffer with `mbind` would split the heap's mappings per expert, past the kernel's
//!   65,530 on a DeepSeek-sized tier). The kernel's answer for a page of each buffer is what
//!   [`summary`] reports (an allocator may hand back memory first touched elsewhere);
//! - a layer's expert groups are claimed by the workers of their node first; a worker whose
//!   node has nothing left takes other nodes' groups, so no core idles while work remains.
//!
//! `MOELANE_NUMA=0` turns it off; `MOELANE_NUMA=fake:N` splits this host's cores into `N`
//! pretend nodes (each one's experts bound to the host node its CPUs are on) to run the
//! node-aware path on a host of one node.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// One memory node the team uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// The kernel's node whose memory this node's experts go to (for a pretend node, the
    /// node its CPUs are on); None where sysfs does not say.
    pub id: Option<u32>,
    /// A pretend node of `MOELANE_NUMA=fake:N`.
    pub pretend: bool,
    /// The CPUs of the node this process may run on (every hardware thread).
    pub cpus: Vec<usize>,
}

/// The nodes the team spreads over (two or more).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub nodes: Vec<Node>,
}

impl Topology {
    /// The index (in `nodes`) of the node `cpu` belongs to.
    pub fn node_of_cpu(&self, cpu: usize) -> Option<usize> {
        self.nodes.iter().position(|n| n.cpus.contains(&cpu))
    }

    /// `cpus` (one per physical core) in the order the team takes them: the first core of
    /// each node, then the second of each, and so on, so a team of fewer threads than cores
    /// still covers every node.
    pub fn spread(&self, cpus: &[usize]) -> Vec<usize> {
        let per: Vec<Vec<usize>> = self
            .nodes
            .iter()
            .map(|n| {
                cpus.iter()
                    .copied()
                    .filter(|c| n.cpus.contains(c))
                    .collect()
            })
            .collect();
        let most = per.iter().map(Vec::len).max().unwrap_or(0);
        let mut out = Vec::with_capacity(cpus.len());
        for i in 0..most {
            out.extend(per.iter().filter_map(|p| p.get(i).copied()));
        }
        // cores in no node (should not happen) keep their place at the end
        out.extend(
            cpus.iter()
                .copied()
                .filter(|c| self.node_of_cpu(*c).is_none()),
        );
        out
    }
}

/// The nodes under `root` (a `/sys/devices/system/node`) that hold CPUs of `allowed`, in node
/// order; nodes without such CPUs (memory-only nodes, CPUs outside the affinity mask) are left
/// out.
pub fn read_nodes(root: &Path, allowed: &[usize]) -> Vec<Node> {
    let mut found: Vec<(u32, Vec<usize>)> = Vec::new();
    let Ok(dir) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix("node"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(list) = std::fs::read_to_string(e.path().join("cpulist")) else {
            continue;
        };
        let cpus: Vec<usize> = crate::team::parse_cpu_list(list.trim())
            .into_iter()
            .filter(|c| allowed.contains(c))
            .collect();
        if !cpus.is_empty() {
            found.push((id, cpus));
        }
    }
    found.sort_by_key(|(id, _)| *id);
    found
        .into_iter()
        .map(|(id, cpus)| Node {
            id: Some(id),
            cpus,
            pretend: false,
        })
        .collect()
}

/// What `MOELANE_NUMA` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Use the host's nodes when there are several (the default).
    Auto,
    Off,
    /// Pretend the cores form this many nodes.
    Fake(usize),
}

/// Reads a `MOELANE_NUMA` value: unset, `auto` or `1`, `0` or `off`, `fake:N` (N from 2 to 64).
pub fn parse_mode(v: Option<&str>) -> Result<Mode, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") | Some("1") => Ok(Mode::Auto),
        Some("0") | Some("off") => Ok(Mode::Off),
        Some(s) => match s.strip_prefix("fake:").map(str::parse::<usize>) {
            Some(Ok(n)) if (2..=64).contains(&n) => Ok(Mode::Fake(n)),
            _ => Err(format!(
                "MOELANE_NUMA={s:?} is not one of auto, 0, off or fake:N (N from 2 to 64)"
            )),
        },
    }
}

/// The topology `mode` gives over `phys` (one CPU per physical core) and `allowed` (every CPU
/// this process may use), the host's nodes read from `root`; None for one node.
pub fn topology_for(
    mode: Mode,
    root: &Path,
    phys: &[usize],
    allowed: &[usize],
) -> Option<Topology> {
    let nodes = match mode {
        Mode::Off => return None,
        Mode::Auto => read_nodes(root, allowed),
        Mode::Fake(n) => {
            // contiguous runs of cores, each with its cores' hardware threads, its memory
            // on the host's node of its first CPU
            let host = read_nodes(root, allowed);
            let n = n.min(phys.len());
            // a core is named by its first hardware thread on both sides (`phys` holds the
            // first allowed one, which need not be it)
            let keys: Vec<usize> = phys.iter().map(|&c| crate::team::core_of(c)).collect();
            (0..n)
                .map(|i| {
                    let cores = &keys[i * keys.len() / n..(i + 1) * keys.len() / n];
                    let mut cpus: Vec<usize> = allowed
                        .iter()
                        .copied()
                        .filter(|&c| cores.contains(&crate::team::core_of(c)))
                        .collect();
                    cpus.sort_unstable();
                    let id = cpus
                        .first()
                        .and_then(|c| host.iter().find(|h| h.cpus.contains(c)))
                        .and_then(|h| h.id);
                    Node {
                        id,
                        cpus,
                        pretend: true,
                    }
                })
                .collect()
        }
    };
    (nodes.len() >= 2).then_some(Topology { nodes })
}

/// The process's topology (`MOELANE_NUMA`, read once; a bad value is said on stderr and
/// taken as `auto`); None on a host of one node or when off.
pub fn topology() -> Option<&'static Topology> {
    static TOPO: OnceLock<Option<Topology>> = OnceLock::new();
    TOPO.get_or_init(|| {
        let mode = parse_mode(std::env::var("MOELANE_NUMA").ok().as_deref()).unwrap_or_else(|e| {
            eprintln!("moelane: {e}; using auto");
            Mode::Auto
        });
        let phys = crate::team::physical_cpus()?;
        let allowed = crate::team::allowed_cpus()?;
        topology_for(mode, Path::new("/sys/devices/system/node"), &phys, &allowed)
    })
    .as_ref()
}

/// The node (index into the topology's nodes, of `nodes`) expert `e` of `experts` belongs to:
/// contiguous blocks of experts per node.
pub fn expert_node(e: usize, experts: usize, nodes: usize) -> usize {
    if experts == 0 || nodes <= 1 {
        return 0;
    }
    (e.min(experts - 1) * nodes) / experts
}

/// The ranges of `0..items` that belong to each of `nodes` nodes, where item `i` is node
/// `node_of(i)`'s and `node_of` does not decrease with `i`; None where it does.
pub fn node_ranges(
    items: usize,
    nodes: usize,
    node_of: impl Fn(usize) -> usize,
) -> Option<Vec<Range<usize>>> {
    let mut out = Vec::with_capacity(nodes);
    let mut i = 0;
    for n in 0..nodes {
        let start = i;
        while i < items && node_of(i) == n {
            i += 1;
        }
        out.push(start..i);
    }
    (i == items).then_some(out)
}

/// Bytes of experts found on their node, per node; found elsewhere; and the policy calls
/// that failed.
struct Placed {
    bytes: Vec<AtomicU64>,
    elsewhere: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<String>>,
}

fn placed() -> &'static Placed {
    static P: OnceLock<Placed> = OnceLock::new();
    P.get_or_init(|| Placed {
        bytes: (0..topology().map_or(0, |t| t.nodes.len()))
            .map(|_| AtomicU64::new(0))
            .collect(),
        elsewhere: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        first_error: Mutex::new(None),
    })
}

/// Builds expert `e` (of `experts` in its layer) with `load`, on a host the team spans
/// several nodes of: with this thread's memory policy preferring the expert's node while
/// `load` runs (so the pages it fills are first touched there), then counts where the
/// kernel says its buffers are. On one node it is `load()`. A refused policy call (a
/// kernel without NUMA calls, a container's seccomp profile) is counted and said by
/// [`summary`], never fatal: the expert then lives where the allocator put it.
pub fn load_expert<E>(
    e: usize,
    experts: usize,
    load: impl FnOnce() -> Result<crate::checkpoint::ExpertWeights, E>,
) -> Result<crate::checkpoint::ExpertWeights, E> {
    let Some(t) = topology() else {
        return load();
    };
    let n = expert_node(e, experts, t.nodes.len());
    let Some(id) = t.nodes[n].id else {
        return load();
    };
    let p = placed();
    let note = |err: String| {
        p.failed.fetch_add(1, Ordering::Relaxed);
        let mut first = p.first_error.lock().unwrap_or_else(|e| e.into_inner());
        first.get_or_insert(err);
    };
    let w = {
        // the policy is back to the default when the guard drops, a panic included
        let _guard = match prefer_node(Some(id)) {
            Ok(()) => Some(PolicyGuard),
            Err(err) => {
                note(err);
                None
            }
        };
        load()?
    };
    let page = page_size();
    for m in [&w.gate_up, &w.down] {
        for (ptr, len) in elem_buffers(&m.data) {
            let Some((start, plen)) = whole_pages(ptr as usize, len, page) else {
                continue;
            };
            match node_of_addr(start as *const u8) {
                Ok(got) if got == id => {
                    if let Some(b) = p.bytes.get(n) {
                        b.fetch_add(plen as u64, Ordering::Relaxed);
                    }
                }
                Ok(_) => {
                    p.elsewhere.fetch_add(plen as u64, Ordering::Relaxed);
                }
                Err(err) => note(err),
            }
        }
    }
    Ok(w)
}

/// Puts the calling thread's memory policy back to the default when dropped.
struct PolicyGuard;

impl Drop for PolicyGuard {
    fn drop(&mut self) {
        let _ = prefer_node(None);
    }
}

/// Bytes of experts found on their own node, per node of the team (empty on one node).
pub fn placed_bytes() -> Vec<u64> {
    placed()
        .bytes
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .collect()
}

/// The heap buffers holding `d`'s elements (and FP8 scales): address and length in bytes.
pub fn elem_buffers(d: &crate::ops::Elems) -> Vec<(*const u8, usize)> {
    use crate::ops::Elems;
    fn raw<T>(v: &[T]) -> (*const u8, usize) {
        (v.as_ptr().cast(), std::mem::size_of_val(v))
    }
    match d {
        Elems::F32(v) => vec![raw(v)],
        Elems::Bf16(v) => vec![raw(v)],
        Elems::F16(v) => vec![raw(v)],
        Elems::F8(q) => vec![raw(&q.v), raw(&q.scales)],
    }
}

/// One line for the logs and the bench headers: the nodes, the team's workers on each, and
/// where the experts' bytes went; None on one node.
pub fn summary() -> Option<String> {
    let t = topology()?;
    let team = crate::team::team();
    let p = placed();
    let nodes: Vec<String> = t
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            format!(
                "{} (CPUs {}; {} spawned workers; {:.1} MB of experts)",
                match (n.pretend, n.id) {
                    (false, Some(id)) => format!("node {id}"),
                    (true, Some(id)) => format!("pretend node {i}, memory on node {id}"),
                    (_, None) => format!("pretend node {i}"),
                },
                cpu_list(&n.cpus),
                team.workers_on(i),
                p.bytes.get(i).map_or(0, |b| b.load(Ordering::Relaxed)) as f64 / 1e6,
            )
        })
        .collect();
    let failed = p.failed.load(Ordering::Relaxed);
    let elsewhere = p.elsewhere.load(Ordering::Relaxed);
    let first = p
        .first_error
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    Some(format!(
        "NUMA: {}; the stepping thread runs on any of them{}{}",
        nodes.join(", "),
        match elsewhere {
            0 => String::new(),
            b => format!("; {:.1} MB of experts on another node", b as f64 / 1e6),
        },
        match (failed, first) {
            (0, _) => String::new(),
            (n, e) => format!("; {n} NUMA calls refused ({})", e.unwrap_or_default()),
        }
    ))
}

/// `[0, 1, 2, 5]` as "0-2,5".
fn cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", cpus[i], cpus[j])
        } else {
            cpus[i].to_string()
        });
        i = j + 1;
    }
    parts.join(",")
}

const MPOL_DEFAULT: libc::c_ulong = 0;
const MPOL_PREFERRED: libc::c_ulong = 1;
const MPOL_F_NODE: libc::c_ulong = 1;
const MPOL_F_ADDR: libc::c_ulong = 1 << 1;

/// The kernel's page size in bytes.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The whole pages inside `[p, p + len)`: (start, length), None when there is none.
fn whole_pages(p: usize, len: usize, page: usize) -> Option<(usize, usize)> {
    let start = p.checked_add(page - 1)? / page * page;
    let end = p.checked_add(len)? / page * page;
    (end > start).then(|| (start, end - start))
}

/// Sets the calling thread's memory policy: new pages preferably on `node`, or (None) the
/// default again.
#[cfg(target_os = "linux")]
pub fn prefer_node(node: Option<u32>) -> Result<(), String> {
    let mut mask = [0 as libc::c_ulong; 16];
    let bits = mask.len() * libc::c_ulong::BITS as usize;
    let mode = match node {
        None => MPOL_DEFAULT,
        Some(n) if (n as usize) < bits => {
            let w = libc::c_ulong::BITS;
            mask[(n / w) as usize] |= 1 << (n % w);
            MPOL_PREFERRED
        }
        Some(n) => {
            return Err(format!(
                "node {n} is past the {bits} nodes this build can name"
            ))
        }
    };
    // SAFETY: set_mempolicy reads `bits` bits of `mask` (maxnode counts one past them, as
    // the kernel expects) and changes only this thread's policy for pages it allocates.
    let r = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            mode,
            if node.is_some() {
                mask.as_ptr()
            } else {
                std::ptr::null()
            },
            if node.is_some() {
                bits as libc::c_ulong + 1
            } else {
                0
            },
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(format!(
            "set_mempolicy to prefer {}: {}",
            node.map_or("the default".to_string(), |n| format!("node {n}")),
            std::io::Error::last_os_error()
        ))
    }
}

#[cfg(not(target_os = "linux"))]
pub fn prefer_node(_node: Option<u32>) -> Result<(), String> {
    Err("NUMA placement needs Linux".into())
}

/// The node holding the page at `p` (which must have been touched), as the kernel says.
#[cfg(target_os = "linux")]
pub fn node_of_addr(p: *const u8) -> Result<u32, String> {
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy with MPOL_F_NODE | MPOL_F_ADDR writes one int (the node of the
    // page at `p`) and reads no mask (null, 0).
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<u64>(),
            0 as libc::c_ulong,
            p as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if r == 0 && node >= 0 {
        Ok(node as u32)
    } else {
        Err(format!(
            "get_mempolicy: {}",
            std::io::Error::last_os_error()
        ))
    }
}

#[cfg(not(target_os = "linux"))]
pub fn node_of_addr(_p: *const u8) -> Result<u32, String> {
    Err("NUMA placement needs Linux".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_sysfs(nodes: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (name, cpus) in nodes {
            let n = d.path().join(name);
            std::fs::create_dir(&n).unwrap();
            std::fs::write(n.join("cpulist"), format!("{cpus}\n")).unwrap();
        }
        std::fs::write(d.path().join("online"), "0-1\n").unwrap();
        d
    }

    #[test]
    fn nodes_are_read_in_order_and_limited_to_the_allowed_cpus() {
        let d = fake_sysfs(&[
            ("node10", "16-23"),
            ("node1", "8-15,40-47"),
            ("node0", "0-7,32-39"),
            ("node2", ""), // memory only
            ("nodex", "1"),
        ]);
        let allowed: Vec<usize> = (0..48).filter(|c| *c != 8).collect();
        let n = read_nodes(d.path(), &allowed);
        let ids: Vec<_> = n.iter().map(|n| n.id).collect();
        assert_eq!(ids, vec![Some(0), Some(1), Some(10)]);
        assert_eq!(n[1].cpus, (9..16).chain(40..48).collect::<Vec<_>>());
        // only node 1's CPUs allowed: one node, no topology
        let t = topology_for(Mode::Auto, d.path(), &[9, 10], &[9, 10, 40]);
        assert!(t.is_none());
        let t = topology_for(Mode::Auto, d.path(), &[0, 9], &allowed).unwrap();
        assert_eq!(t.nodes.len(), 3);
        assert!(topology_for(Mode::Off, d.path(), &[0, 9], &allowed).is_none());
        // no sysfs at all: one node
        assert!(read_nodes(Path::new("/nonexistent/moelane"), &allowed).is_empty());
    }

    #[test]
    fn pretend_nodes_keep_their_memory_on_the_hosts_node() {
        let d = fake_sysfs(&[("node0", "0-1"), ("node3", "2-3")]);
        let t = topology_for(Mode::Fake(4), d.path(), &[0, 1, 2, 3], &[0, 1, 2, 3]).unwrap();
        let ids: Vec<_> = t.nodes.iter().map(|n| n.id).collect();
        assert_eq!(ids, vec![Some(0), Some(0), Some(3), Some(3)]);
    }

    #[test]
    fn the_team_order_covers_every_node_first() {
        let t = Topology {
            nodes: vec![
                Node {
                    id: Some(0),
                    cpus: vec![0, 1, 2, 3],
                    pretend: false,
                },
                Node {
                    id: Some(1),
                    cpus: vec![4, 5],
                    pretend: false,
                },
            ],
        };
        assert_eq!(t.spread(&[0, 1, 2, 3, 4, 5, 9]), vec![0, 4, 1, 5, 2, 3, 9]);
        assert_eq!(t.node_of_cpu(5), Some(1));
        assert_eq!(t.node_of_cpu(9), None);
    }

    #[test]
    fn modes_parse_and_bad_ones_are_named() {
        assert_eq!(parse_mode(None), Ok(Mode::Auto));
        assert_eq!(parse_mode(Some("off")), Ok(Mode::Off));
        assert_eq!(parse_mode(Some("0")), Ok(Mode::Off));
        assert_eq!(parse_mode(Some("fake:4")), Ok(Mode::Fake(4)));
        for bad in ["fake:1", "fake:x", "fake:65", "yes", "fake:"] {
            let e = parse_mode(Some(bad)).unwrap_err();
            assert!(e.contains("MOELANE_NUMA") && e.contains(bad), "{e}");
        }
        // pretend nodes split the cores into contiguous runs
        let phys = [0, 1, 2, 3, 4];
        let t = topology_for(Mode::Fake(2), Path::new("/nonexistent"), &phys, &phys).unwrap();
        assert_eq!(t.nodes.len(), 2);
        assert!(t.nodes.iter().all(|n| n.id.is_none() && n.pretend));
        let all: Vec<usize> = t.nodes.iter().flat_map(|n| n.cpus.clone()).collect();
        assert_eq!(all, vec![0, 1, 2, 3, 4]);
        // more pretend nodes than cores: one per core
        let t = topology_for(Mode::Fake(8), Path::new("/x"), &[0, 1], &[0, 1]).unwrap();
        assert_eq!(t.nodes.len(), 2);
    }

    #[test]
    fn experts_go_to_nodes_in_blocks_and_ranges_partition() {
        let nodes: Vec<usize> = (0..10).map(|e| expert_node(e, 10, 3)).collect();
        assert_eq!(nodes, vec![0, 0, 0, 0, 1, 1, 1, 2, 2, 2]);
        assert_eq!(expert_node(99, 10, 3), 2);
        assert_eq!(expert_node(5, 0, 3), 0);
        let r = node_ranges(10, 3, |i| nodes[i]).unwrap();
        assert_eq!(r, vec![0..4, 4..7, 7..10]);
        // a node with nothing gets an empty range
        let r = node_ranges(3, 3, |i| [0, 2, 2][i]).unwrap();
        assert_eq!(r, vec![0..1, 1..1, 1..3]);
        // out of order: None
        assert!(node_ranges(3, 2, |i| [1, 0, 1][i]).is_none());
        assert_eq!(node_ranges(0, 2, |_| 0).unwrap(), vec![0..0, 0..0]);
    }

    #[test]
    fn cpu_lists_print_as_ranges() {
        assert_eq!(cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(cpu_list(&[3]), "3");
        assert_eq!(cpu_list(&[]), "");
        let back = crate::team::parse_cpu_list(&cpu_list(&[0, 1, 2, 5, 7, 8]));
        assert_eq!(back, vec![0, 1, 2, 5, 7, 8]);
    }

    #[test]
    fn whole_pages_only() {
        assert_eq!(whole_pages(4096, 8192, 4096), Some((4096, 8192)));
        assert_eq!(whole_pages(4097, 8192, 4096), Some((8192, 4096)));
        assert_eq!(whole_pages(100, 1000, 4096), None);
        assert_eq!(whole_pages(usize::MAX - 10, 100, 4096), None);
    }

    #[test]
    fn pages_first_touched_under_a_preferred_node_are_there() {
        // node 0 exists on every Linux host; where the kernel or a container forbids the
        // calls, say so (the engine then leaves experts where the allocator puts them)
        let page = page_size();
        let got = std::thread::spawn(move || {
            prefer_node(Some(0))?;
            let v = vec![1u8; 64 * page];
            let (start, _) = whole_pages(v.as_ptr() as usize, v.len(), page).unwrap();
            let n = node_of_addr(start as *const u8);
            prefer_node(None)?;
            n
        })
        .join()
        .unwrap();
        match got {
            Ok(n) => assert_eq!(n, 0),
            Err(e) => {
                assert!(
                    e.contains("set_mempolicy") || e.contains("get_mempolicy"),
                    "{e}"
                );
                eprintln!("skipped: this host refuses the NUMA calls ({e})");
            }
        }
        // a node past the mask is an error that names it, never a crash
        let e = prefer_node(Some(5000)).unwrap_err();
        assert!(e.contains("node 5000"), "{e}");
    }
}
