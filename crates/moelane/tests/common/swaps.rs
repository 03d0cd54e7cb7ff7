//! Live swaps under load: a swapper forcing random hot/cold exchanges while four clients
//! generate, and the check that nothing but placement changed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::*;
use moelane_engine::rng::Rng;
use moelane_engine::rowmap::Rowmap;
use moelane_proto::lane::primary_client::PrimaryClient;
use moelane_proto::lane::{Move, SwapRequest};

/// Swaps random hot/cold pairs until stopped; returns how many committed.
pub fn swapper(
    primary: String,
    map: Rowmap,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut c = PrimaryClient::connect(primary).await.unwrap();
            let mut map = map;
            let mut rng = Rng::new(42);
            while !stop.load(Ordering::Relaxed) {
                let l = rng.below(map.layers.len());
                let lm = &map.layers[l];
                let (h, k) = (
                    lm.hot[rng.below(lm.hot.len())],
                    lm.cold[rng.below(lm.cold.len())],
                );
                let r = c
                    .swap(SwapRequest {
                        moves: vec![
                            Move {
                                layer: l as u32,
                                expert: h as u32,
                                to_hot: false,
                            },
                            Move {
                                layer: l as u32,
                                expert: k as u32,
                                to_hot: true,
                            },
                        ],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert!(r.committed, "swap aborted: {}", r.abort_reason);
                let lm = &mut map.layers[l];
                lm.hot.retain(|&x| x != h);
                lm.cold.retain(|&x| x != k);
                lm.hot.push(k);
                lm.cold.push(h);
                done.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        });
    })
}

pub fn run_all(addr: &str, ps: &[String]) -> Vec<String> {
    // four clients at once, so swaps land in batched steps too
    let chunks: Vec<Vec<(usize, String)>> = (0..4)
        .map(|t| {
            ps.iter()
                .cloned()
                .enumerate()
                .filter(|(i, _)| i % 4 == t)
                .collect()
        })
        .collect();
    let mut out = vec![String::new(); ps.len()];
    let hs: Vec<_> = chunks
        .into_iter()
        .map(|c| {
            let a = addr.to_string();
            std::thread::spawn(move || {
                c.into_iter()
                    .map(|(i, p)| (i, complete(&a, &p, 32)))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in hs {
        for (i, t) in h.join().unwrap() {
            out[i] = t;
        }
    }
    out
}

pub fn lossless_on(gateway: &str, primary: &str) {
    let ps = prompts50();
    assert_eq!(ps.len(), 50);
    let want = run_all(gateway, &ps);
    let map = Rowmap::read(&tiny().join("rowmap.json")).unwrap();
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let h = swapper(primary.to_string(), map, stop.clone(), done.clone());
    let got = run_all(gateway, &ps);
    stop.store(true, Ordering::Relaxed);
    h.join().unwrap();
    let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
    let swaps = done.load(Ordering::Relaxed);
    eprintln!("{same}/50 identical with {swaps} swaps committed during generation");
    assert_eq!(same, 50);
    assert!(swaps >= 10, "only {swaps} swaps happened");
}
