//! The node-aware team and expert placement (`MOELANE_NUMA`): the same greedy tokens, one
//! prompt at a time and all in one batch, with the team split into two pretend nodes as
//! without NUMA, each run in its own process (the team is made once per process); in the
//! pretend-node run every expert's bytes are bound to the memory node of its node's CPUs.

mod common;

use std::process::Command;

use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::rowmap::Tier;
use moelane_engine::synth::{prompts, LANGS};
use moelane_engine::tokenizer::Tokenizer;

const NEW: usize = 24;

/// Runs in a child process (`MOELANE_NUMA_CHILD` set): decodes and prints the tokens.
#[test]
fn child_decodes() {
    let Ok(dir) = std::env::var("MOELANE_NUMA_CHILD") else {
        return;
    };
    let dir = std::path::Path::new(&dir);
    let team = moelane_engine::team::team();
    let want_nodes: usize = std::env::var("MOELANE_NUMA")
        .ok()
        .and_then(|v| v.strip_prefix("fake:").and_then(|n| n.parse().ok()))
        .unwrap_or(1);
    assert_eq!(team.nodes(), want_nodes, "the team's nodes");
    let ckpt = Checkpoint::open(dir).unwrap();
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let ps: Vec<Vec<u32>> = (0..LANGS.len())
        .flat_map(|l| prompts(l).into_iter().take(3))
        .map(|p| tok.encode(p).unwrap())
        .collect();
    // the checkpoint's own map: hot experts in the engine, cold on the in-process sidecar
    let mut eng = common::engine(dir, None);
    let one: Vec<Vec<u32>> = ps.iter().map(|p| eng.greedy(p, NEW).unwrap()).collect();
    let all = common::batched(&mut eng, &ps, NEW);
    assert_eq!(one, all, "one at a time against one batch");
    let s = moelane_engine::numa::summary();
    if let Some(s) = s.as_deref().filter(|s| s.contains("refused")) {
        // a container's seccomp profile (Docker's default without CAP_SYS_NICE) forbids
        // the NUMA calls: the engine goes on with the experts where they were loaded
        eprintln!("skipped the placement checks: {s}");
    } else if want_nodes > 1 {
        // every expert was built under its node's policy and each pretend node got some
        let placed = moelane_engine::numa::placed_bytes();
        assert_eq!(placed.len(), want_nodes);
        let page = moelane_engine::numa::page_size();
        if page <= 4096 {
            assert!(placed.iter().all(|&b| b > 0), "bytes per node {placed:?}");
        }
        // and the kernel says they sit on the node of their pretend node's CPUs
        let map = moelane_engine::load::resolve_map(&ckpt, None).unwrap();
        let bank = moelane_engine::bank::ExpertBank::load(
            &ckpt,
            &map,
            Tier::Hot,
            &ckpt.config.moe_layers(),
            None,
        )
        .unwrap();
        let topo = moelane_engine::numa::topology().unwrap();
        let experts = ckpt.config.num_experts;
        let mut checked = 0;
        for (e, w) in bank.experts_of(0) {
            let want = topo.nodes[moelane_engine::numa::expert_node(e, experts, want_nodes)].id;
            // the first whole page inside the buffer (pages at the ends are shared)
            let (p, bytes) = moelane_engine::numa::elem_buffers(&w.gate_up.data)[0];
            let first = (p as usize).div_ceil(page) * page;
            if first + page > p as usize + bytes {
                continue;
            }
            let at = p.wrapping_add(first - p as usize);
            assert_eq!(
                moelane_engine::numa::node_of_addr(at).ok(),
                want,
                "expert {e}"
            );
            checked += 1;
        }
        // tiny's buffers (4-8 KB) hold a whole page where pages are 4 KiB
        assert!(checked > 0 || page > 4096);
    }
    println!("TOKENS {}", serde_json::to_string(&one).unwrap());
}

fn run_child(dir: &std::path::Path, numa: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_decodes",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("MOELANE_NUMA_CHILD", dir)
        .env("MOELANE_NUMA", numa)
        .env("MOELANE_THREADS", "2")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child with MOELANE_NUMA={numa} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.split_once("TOKENS ").map(|(_, t)| t.to_string()))
        .unwrap_or_else(|| panic!("no tokens from the child with MOELANE_NUMA={numa}:\n{text}"))
}

#[test]
fn pretend_nodes_decode_the_same_tokens() {
    if std::env::var("MOELANE_NUMA_CHILD").is_ok() {
        return;
    }
    let cores = moelane_engine::team::physical_cpus().map_or(0, |c| c.len());
    if cores < 2 {
        eprintln!("skipped: two pretend nodes need two cores, this process may use {cores}");
        return;
    }
    let dir = common::tiny();
    let off = run_child(dir, "0");
    let two = run_child(dir, "fake:2");
    assert_eq!(off, two, "MOELANE_NUMA=fake:2 against 0");
}
