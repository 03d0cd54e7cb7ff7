//! The step's worker team: one thread per physical core (the caller is one of them) that
//! spin-waits between the step's parallel regions instead of sleeping, so a region costs
//! a cache line's round trip, not a scheduler wake-up. A step has about five regions per
//! layer (the attention projections, the heads, the router, the experts); handing each to
//! a general pool that parks its threads cost more than the work itself at batch 1.
//!
//! A job is open from its posting until the caller has claimed the last task; a worker
//! joins it only while it is open (one atomic word holds the job's number, the open flag
//! and the count of workers inside), and the caller returns once the workers inside have
//! left, so the job (a borrowed closure) never outlives its caller and a worker that was
//! asleep never delays one. Tasks are claimed from an atomic counter; which thread runs a
//! task never changes what it computes, so results do not depend on the team's size. One
//! job at a time: a caller that finds the team busy (another engine, the in-process
//! sidecar, or a task of the running job) runs its tasks itself. Workers that have spun
//! `MOELANE_SPIN_US` (default 200 us) without a job sleep until the next one.
//!
//! On a host of several memory nodes ([`crate::numa`]) each worker belongs to a node and a
//! placed job ([`Team::run_placed`]) gives each node a range of its tasks: a thread claims
//! its own node's tasks first, then the others', so every task still runs exactly once.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A posted job: `tasks` calls of `f`, by index; for a placed job, each node's range of
/// them (empty otherwise).
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    ranges: *const [Range<usize>],
}

static NO_RANGES: [Range<usize>; 0] = [];

fn nothing(_: usize) {}
static NOTHING: fn(usize) = nothing;

/// `state`: the job's number in the high 32 bits, [`OPEN`], and the workers inside.
const OPEN: u64 = 1 << 31;
const INSIDE: u64 = OPEN - 1;

struct Shared {
    /// The job's number, open flag and workers inside (see [`OPEN`]); `job` is written
    /// before a job opens (release) and read by workers that joined it (acquire).
    state: AtomicU64,
    job: UnsafeCell<Job>,
    next: AtomicUsize,
    /// A placed job's claim counters, one per node (node `n` hands out its range's tasks).
    node_next: Box<[AtomicUsize]>,
    /// The most workers that join the open job (its tasks but the caller's one): more
    /// would only contend for the task counter.
    helpers: AtomicU64,
    sleep: Mutex<u64>,
    wake: Condvar,
    stop: AtomicBool,
    /// A worker's task panicked in the current job (the caller panics in turn).
    panicked: AtomicBool,
    spin: Duration,
}

// SAFETY: `job` is written only by the thread holding `Team::busy`, while no job is open
// and no worker is inside one (the previous `run` waited for that), and read by workers
// only between joining the open job (a CAS that sees the open flag, acquire, after the
// write's release) and leaving it.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// Where a spawned worker runs: the CPUs it is kept on (empty: anywhere) and its node.
#[derive(Clone, Debug, Default)]
pub struct Seat {
    pub cpus: Vec<usize>,
    pub node: usize,
}

/// A fixed team of worker threads for the step's data-parallel regions.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    busy: Mutex<()>,
    pinned: bool,
    /// The node of each spawned worker; the node of each CPU (for the caller's), where
    /// the team spans several nodes.
    seats: Vec<usize>,
    cpu_node: Vec<u16>,
}

impl Team {
    /// A team of `threads` (the caller counts as one: `threads - 1` are spawned), each
    /// spawned thread pinned to one CPU of `cpus` when given; idle workers spin `spin`
    /// before they sleep.
    pub fn new(threads: usize, cpus: Option<&[usize]>, spin: Duration) -> Team {
        // one thread a core: threads past the cores given stay unpinned
        let seats = (1..threads.clamp(1, MAX_THREADS))
            .map(|w| Seat {
                cpus: cpus.and_then(|c| c.get(w).copied()).into_iter().collect(),
                node: 0,
            })
            .collect();
        let mut t = Team::seated(seats, 1, Vec::new(), spin);
        t.pinned = cpus.is_some_and(|c| !c.is_empty());
        t
    }

    /// A team of the caller and one spawned worker per seat, over `nodes` nodes;
    /// `cpu_node[c]` is CPU `c`'s node (the caller's node is looked up there per job).
    pub fn seated(seats: Vec<Seat>, nodes: usize, cpu_node: Vec<u16>, spin: Duration) -> Team {
        let nodes = nodes.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                f: &NOTHING,
                tasks: 0,
                ranges: &NO_RANGES,
            }),
            next: AtomicUsize::new(0),
            node_next: (0..nodes).map(|_| AtomicUsize::new(0)).collect(),
            helpers: AtomicU64::new(0),
            sleep: Mutex::new(0),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            spin,
        });
        let mut workers = Vec::new();
        let mut placed = Vec::new();
        for (i, seat) in seats.into_iter().enumerate() {
            let s = shared.clone();
            let node = seat.node.min(nodes - 1);
            let h = std::thread::Builder::new()
                .name(format!("moelane-team-{}", i + 1))
                .spawn(move || {
                    if !seat.cpus.is_empty() {
                        pin_to(&seat.cpus);
                    }
                    worker(&s, node)
                });
            match h {
                Ok(h) => {
                    workers.push(h);
                    placed.push(node);
                }
                // fewer threads than asked: the team still works, only slower
                Err(_) => break,
            }
        }
        Team {
            shared,
            workers,
            busy: Mutex::new(()),
            pinned: false,
            seats: placed,
            cpu_node,
        }
    }

    /// The memory nodes the team spans (1 on most hosts).
    pub fn nodes(&self) -> usize {
        self.shared.node_next.len()
    }

    /// Spawned workers on node `n` (the caller aside).
    pub fn workers_on(&self, n: usize) -> usize {
        self.seats.iter().filter(|&&s| s == n).count()
    }

    /// The node the calling thread runs on now (0 where it cannot be told).
    fn caller_node(&self) -> usize {
        if self.nodes() == 1 {
            return 0;
        }
        current_cpu()
            .and_then(|c| self.cpu_node.get(c))
            .map_or(0, |&n| (n as usize).min(self.nodes() - 1))
    }

    /// Threads that run a job (the caller included).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// Runs `f(0) .. f(tasks - 1)` across the team and returns when all have run. Runs
    /// them on the calling thread when there is one task, no workers, or the team is busy.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        self.post(tasks, &NO_RANGES, f)
    }

    /// Runs the tasks of `ranges` (one per node, together `0..n` in order; node `i`'s
    /// tasks are `ranges[i]`) across the team, each node's workers taking their own
    /// node's tasks before the others'. Where the team spans one node, or `ranges` is not
    /// such a partition, it is [`Team::run`] over every task.
    pub fn run_placed(&self, ranges: &[Range<usize>], f: &(dyn Fn(usize) + Sync)) {
        let tasks = ranges.iter().map(|r| r.end).max().unwrap_or(0);
        let partition = ranges.len() == self.nodes()
            && ranges.first().is_some_and(|r| r.start == 0)
            && ranges.iter().all(|r| r.start <= r.end)
            && ranges.windows(2).all(|w| w[0].end == w[1].start);
        if self.nodes() == 1 || !partition {
            return self.run(tasks, f);
        }
        self.post(tasks, ranges, f)
    }

    fn post(&self, tasks: usize, ranges: &[Range<usize>], f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if tasks == 1 || self.workers.is_empty() {
            (0..tasks).for_each(f);
            return;
        }
        let _guard = match self.busy.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let s = &*self.shared;
        // SAFETY: no job is open and no worker is inside one (the last `run` returned only
        // then), so none reads `job` now; workers dereference the pointer only while inside
        // this job, which this call waits for, so `f` outlives every use.
        unsafe {
            *s.job.get() = Job {
                f: std::mem::transmute::<&(dyn Fn(usize) + Sync), *const (dyn Fn(usize) + Sync)>(f),
                tasks,
                ranges: ranges as *const [Range<usize>],
            };
        }
        s.next.store(0, Ordering::Relaxed);
        for (c, r) in s.node_next.iter().zip(ranges) {
            c.store(r.start, Ordering::Relaxed);
        }
        s.helpers.store(tasks as u64 - 1, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let number = (s.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xffff_ffff;
        s.state.store((number << 32) | OPEN, Ordering::Release);
        {
            // wake sleepers (they re-check `state` under this lock, so none misses the job)
            let sleepers = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            if *sleepers > 0 {
                s.wake.notify_all();
            }
        }
        // A panicking task must not leave workers inside a job whose closure is gone:
        // the caller's own tasks are caught and the panic resumed after the workers leave.
        let node = self.caller_node();
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            claim(s, f, tasks, ranges, node)
        }));
        // every task is claimed: close the job (no worker joins now), then wait for the
        // workers inside to finish theirs
        s.state.fetch_and(!OPEN, Ordering::AcqRel);
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) & INSIDE != 0 {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.load(Ordering::Acquire) {
            panic!("a task of the worker team panicked");
        }
    }
}

impl Team {
    /// `f(i, chunk)` for each `chunk`-long piece of `v` (the last may be shorter), across
    /// the team: the pieces are disjoint, so each task has its own.
    pub fn for_each_chunk<T: Send>(
        &self,
        v: &mut [T],
        chunk: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let chunk = chunk.max(1);
        let (len, base) = (v.len(), ChunkPtr(v.as_mut_ptr()));
        self.run(len.div_ceil(chunk), &|i| {
            let (a, b) = (i * chunk, ((i + 1) * chunk).min(len));
            let p = &base;
            // SAFETY: a < b <= len, and task i alone gets [a, b): the pieces are
            // disjoint, inside `v`, and `v` is borrowed mutably for the whole call.
            let piece = unsafe { std::slice::from_raw_parts_mut(p.0.add(a), b - a) };
            f(i, piece)
        });
    }
}

struct ChunkPtr<T>(*mut T);
// SAFETY: used only to hand disjoint pieces of one slice of Send elements to tasks.
unsafe impl<T: Send> Sync for ChunkPtr<T> {}

/// Claims and runs tasks until none is left: from the one counter, or for a placed job from
/// `node`'s range first, then from each other node's in turn.
fn claim(
    s: &Shared,
    f: &(dyn Fn(usize) + Sync),
    tasks: usize,
    ranges: &[Range<usize>],
    node: usize,
) {
    if ranges.is_empty() {
        loop {
            let t = s.next.fetch_add(1, Ordering::Relaxed);
            if t >= tasks {
                return;
            }
            f(t);
        }
    }
    let n = ranges.len();
    for j in 0..n {
        let i = (node + j) % n;
        let end = ranges[i].end;
        loop {
            let t = s.node_next[i].fetch_add(1, Ordering::Relaxed);
            if t >= end {
                break;
            }
            f(t);
        }
    }
}

fn worker(s: &Shared, node: usize) {
    let mut seen = 0u64;
    loop {
        // wait for a new open job: spin, then yield, then sleep
        let mut t0 = Instant::now();
        let mut spins = 0u32;
        let fresh = |st: u64| st >> 32 != seen && st & OPEN != 0;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            if fresh(s.state.load(Ordering::Acquire)) {
                break;
            }
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
                continue;
            }
            if t0.elapsed() < s.spin {
                // let other runnable threads (the sidecar, the runtime) have the core
                std::thread::yield_now();
                continue;
            }
            let mut sleepers = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            *sleepers += 1;
            while !fresh(s.state.load(Ordering::Acquire)) && !s.stop.load(Ordering::Acquire) {
                sleepers = s
                    .wake
                    .wait_timeout(sleepers, Duration::from_millis(100))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
            *sleepers -= 1;
            // woken: spin again before sleeping (the next jobs of a burst come soon)
            t0 = Instant::now();
            spins = 0;
        }
        // join the job while it is open (the caller closes it once every task is claimed)
        let mut st = s.state.load(Ordering::Acquire);
        let joined = loop {
            if !fresh(st) || st & INSIDE >= s.helpers.load(Ordering::Relaxed) {
                break false;
            }
            match s
                .state
                .compare_exchange_weak(st, st + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break true,
                Err(now) => st = now,
            }
        };
        seen = st >> 32;
        if !joined {
            continue;
        }
        // SAFETY: see `Shared`: this worker is inside the open job, whose `job` was
        // written before it opened (release/acquire), and stays valid until it leaves.
        let job = unsafe { *s.job.get() };
        let f = unsafe { &*job.f };
        let ranges = unsafe { &*job.ranges };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            claim(s, f, job.tasks, ranges, node)
        }));
        if r.is_err() {
            // the caller panics once every worker has left; this worker keeps serving
            s.panicked.store(true, Ordering::Release);
        }
        s.state.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _g = self.shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The most threads a team spawns (a larger `MOELANE_THREADS` is taken as this).
const MAX_THREADS: usize = 1024;

fn spin_time() -> Duration {
    let us = std::env::var("MOELANE_SPIN_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(200);
    Duration::from_micros(us)
}

/// Keeps the calling thread on `cpus` (those past CPU_SETSIZE ignored; none left: unchanged).
#[cfg(target_os = "linux")]
fn pin_to(cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays inside it for
    // cpu < CPU_SETSIZE (checked); sched_setaffinity(0) affects this thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let mut any = false;
        for &cpu in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(cpu, &mut set);
            any = true;
        }
        if any {
            let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to(_cpus: &[usize]) {}

/// The CPU the calling thread runs on now.
#[cfg(target_os = "linux")]
fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu has no arguments and no memory effects.
    let c = unsafe { libc::sched_getcpu() };
    (c >= 0).then_some(c as usize)
}

#[cfg(not(target_os = "linux"))]
fn current_cpu() -> Option<usize> {
    None
}

/// The CPUs this process may run on (its affinity mask), one per physical core (the
/// first hardware thread of each core), in order; None where that cannot be read.
pub fn physical_cpus() -> Option<Vec<usize>> {
    let allowed = allowed_cpus()?;
    let mut cores = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for &c in &allowed {
        if cores.insert(core_of(c)) {
            out.push(c);
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The first hardware thread of `cpu`'s core (itself where sysfs does not say).
pub fn core_of(cpu: usize) -> usize {
    std::fs::read_to_string(format!(
        "/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    ))
    .ok()
    .and_then(|s| parse_cpu_list(s.trim()).into_iter().next())
    .unwrap_or(cpu)
}

/// Every CPU this process may run on (its affinity mask), in order.
#[cfg(target_os = "linux")]
pub fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: sched_getaffinity fills the zeroed set it is given (its size passed).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        let v: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect();
        (!v.is_empty()).then_some(v)
    }
}

#[cfg(not(target_os = "linux"))]
pub fn allowed_cpus() -> Option<Vec<usize>> {
    None
}

/// "0-3,8,10-11" as CPU numbers (bad parts skipped).
pub fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    if a <= b && b - a < 1 << 16 {
                        out.extend(a..=b);
                    }
                }
            }
            None => {
                if let Ok(c) = part.parse() {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// The process's team: `MOELANE_THREADS` threads (default: one per physical core this
/// process may run on, no more than its CPU quota), pinned one per core when `MOELANE_PIN=1` (on a host shared with
/// other work, unpinned threads move away from busy cores). On a host of several memory
/// nodes ([`crate::numa::topology`]) the workers are spread over the nodes and each kept on
/// its node's CPUs (on its core with `MOELANE_PIN=1`).
pub fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let topo = crate::numa::topology();
        let phys = physical_cpus().map(|p| topo.map_or_else(|| p.clone(), |t| t.spread(&p)));
        let threads = std::env::var("MOELANE_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&t| t > 0)
            .unwrap_or_else(|| {
                // the CPUs the process may use, cgroup quota included, capped at one per
                // physical core (spinning workers past a container's quota would stall)
                let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
                phys.as_ref().map_or(allowed, |p| p.len().min(allowed))
            });
        let pin = std::env::var("MOELANE_PIN").is_ok_and(|v| v == "1");
        match topo {
            None => Team::new(
                threads,
                if pin { phys.as_deref() } else { None },
                spin_time(),
            ),
            Some(t) => {
                let (seats, cpu_node) = numa_seats(t, phys.as_deref().unwrap_or(&[]), threads, pin);
                let mut team = Team::seated(seats, t.nodes.len(), cpu_node, spin_time());
                team.pinned = pin;
                team
            }
        }
    })
}

/// The spawned workers' seats over `t`: worker `w` takes core `cores[w]` (the caller counts as
/// core 0's) and is kept on that core (`pin`) or on its node's CPUs; workers past the cores
/// go round the nodes. Also each CPU's node.
fn numa_seats(
    t: &crate::numa::Topology,
    cores: &[usize],
    threads: usize,
    pin: bool,
) -> (Vec<Seat>, Vec<u16>) {
    let n = t.nodes.len();
    let seats = (1..threads.clamp(1, MAX_THREADS))
        .map(|w| {
            let core = cores.get(w).copied();
            let node = core.and_then(|c| t.node_of_cpu(c)).unwrap_or(w % n);
            let cpus = match (core, pin) {
                (Some(c), true) => vec![c],
                _ => t.nodes[node].cpus.clone(),
            };
            Seat { cpus, node }
        })
        .collect();
    let top = t
        .nodes
        .iter()
        .flat_map(|n| n.cpus.iter())
        .max()
        .map_or(0, |m| m + 1);
    let mut cpu_node = vec![0u16; top];
    for (i, nd) in t.nodes.iter().enumerate() {
        for &c in &nd.cpus {
            cpu_node[c] = i as u16;
        }
    }
    (seats, cpu_node)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once_whatever_the_team() {
        for threads in [1, 2, 3, 5] {
            let t = Team::new(threads, None, Duration::from_micros(200));
            for tasks in [0, 1, 2, 7, 100, 1000] {
                let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
                t.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn nested_and_concurrent_callers_run_inline() {
        let t = Arc::new(Team::new(3, None, Duration::from_micros(200)));
        let total = AtomicUsize::new(0);
        t.run(8, &|_| {
            // a task's own job finds the team busy and runs on this thread
            t.run(4, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 32);
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let n = AtomicUsize::new(0);
                    for _ in 0..200 {
                        t.run(16, &|_| {
                            n.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    n.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().ok(), Some(3200));
        }
    }

    #[test]
    fn workers_wake_after_sleeping_and_a_panic_is_the_callers() {
        let t = Team::new(2, None, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(20));
        let n = AtomicUsize::new(0);
        t.run(10, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.run(64, &|i| {
                if i == 63 {
                    panic!("task 63");
                }
            })
        }));
        // the panic reached the caller, on whichever thread the task ran; the team still
        // runs jobs
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        t.run(10, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn chunks_are_disjoint_and_cover_the_slice() {
        let t = Team::new(3, None, Duration::from_micros(200));
        for (len, chunk) in [(0, 4), (1, 4), (10, 3), (64, 8), (65, 8)] {
            let mut v = vec![0usize; len];
            t.for_each_chunk(&mut v, chunk, &|i, piece| {
                for (j, x) in piece.iter_mut().enumerate() {
                    *x += i * chunk + j + 1;
                }
            });
            assert_eq!(v, (1..=len).collect::<Vec<_>>());
        }
    }

    fn two_nodes(workers: usize) -> Team {
        let seats = (0..workers)
            .map(|w| Seat {
                cpus: Vec::new(),
                node: w % 2,
            })
            .collect();
        Team::seated(seats, 2, vec![0, 1], Duration::from_micros(200))
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one range for two nodes is the case tested
    fn placed_jobs_run_every_task_once() {
        for workers in [0, 1, 3] {
            let t = two_nodes(workers);
            assert_eq!(t.nodes(), 2);
            assert_eq!(t.workers_on(0) + t.workers_on(1), workers);
            for ranges in [
                vec![0..5, 5..9],
                vec![0..0, 0..7],
                vec![0..7, 7..7],
                vec![0..1, 1..200],
                vec![0..0, 0..0],
                // not a partition of 0..n (or not one range a node): every task of 0..end
                vec![0..3],
                vec![1..3, 3..6],
                vec![0..4, 3..6],
                vec![0..5, 2..3],
            ] {
                let end = ranges.iter().map(|r| r.end).max().unwrap_or(0);
                for _ in 0..50 {
                    let hits: Vec<AtomicU32> = (0..end).map(|_| AtomicU32::new(0)).collect();
                    t.run_placed(&ranges, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert!(
                        hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                        "{workers} workers, {ranges:?}"
                    );
                }
                // plain jobs still work on a placed team
                let n = AtomicUsize::new(0);
                t.run(33, &|_| {
                    n.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(n.load(Ordering::Relaxed), 33);
            }
        }
    }

    #[test]
    fn a_thread_claims_its_own_nodes_tasks_first() {
        let t = two_nodes(0);
        let s = &*t.shared;
        let ranges = [0..3, 3..5];
        let order = Mutex::new(Vec::new());
        for node in [0, 1] {
            for (c, r) in s.node_next.iter().zip(&ranges) {
                c.store(r.start, Ordering::Relaxed);
            }
            order.lock().unwrap().clear();
            claim(s, &|i| order.lock().unwrap().push(i), 5, &ranges, node);
            let want = if node == 0 {
                vec![0, 1, 2, 3, 4]
            } else {
                vec![3, 4, 0, 1, 2]
            };
            assert_eq!(*order.lock().unwrap(), want);
        }
    }

    #[test]
    fn numa_seats_cover_the_nodes() {
        let t = crate::numa::Topology {
            nodes: vec![
                crate::numa::Node {
                    id: Some(0),
                    cpus: vec![0, 1, 4, 5],
                    pretend: false,
                },
                crate::numa::Node {
                    id: Some(1),
                    cpus: vec![2, 3, 6, 7],
                    pretend: false,
                },
            ],
        };
        let cores = t.spread(&[0, 1, 2, 3]);
        assert_eq!(cores, vec![0, 2, 1, 3]);
        let (seats, cpu_node) = numa_seats(&t, &cores, 6, false);
        let nodes: Vec<usize> = seats.iter().map(|s| s.node).collect();
        // workers 1..3 on cores 2, 1, 3; workers past the cores round the nodes
        assert_eq!(nodes, vec![1, 0, 1, 0, 1]);
        assert_eq!(seats[0].cpus, vec![2, 3, 6, 7]);
        assert_eq!(cpu_node, vec![0, 0, 1, 1, 0, 0, 1, 1]);
        let (seats, _) = numa_seats(&t, &cores, 3, true);
        assert_eq!(seats[0].cpus, vec![2]);
        assert_eq!(seats[1].cpus, vec![1]);
    }

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("5"), vec![5]);
        assert_eq!(parse_cpu_list("x,3-1,2"), vec![2]);
        assert!(physical_cpus().is_none_or(|c| !c.is_empty()));
    }
}
