//! The host's memory as the benches and the sidecar report it: the last-level cache and the
//! read bandwidth measured over a buffer several times that cache (so it is a DRAM figure).

use std::time::Instant;

/// The last-level cache's size in bytes: the largest cache of cpu0 that Linux lists in sysfs
/// (None where it lists none).
pub fn last_level_cache() -> Option<u64> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let Ok(text) = std::fs::read_to_string(e.path().join("size")) else {
            continue;
        };
        let t = text.trim();
        let (num, mult) = match t.as_bytes().last() {
            Some(b'K') => (&t[..t.len() - 1], 1u64 << 10),
            Some(b'M') => (&t[..t.len() - 1], 1 << 20),
            Some(b'G') => (&t[..t.len() - 1], 1 << 30),
            _ => (t, 1),
        };
        if let Ok(v) = num.parse::<u64>() {
            best = best.max(Some(v * mult));
        }
    }
    best
}

/// Bytes the read-bandwidth probe reads: four times the last-level cache (so at most a
/// quarter of it can come from there), at least 512 MiB, at most 4 GiB.
pub fn read_probe_bytes(llc: Option<u64>) -> u64 {
    (4 * llc.unwrap_or(0)).clamp(512 << 20, 4 << 30)
}

/// Measures read bandwidth (bytes per second): every thread of the worker team the engine
/// uses summing its share of a buffer of [`read_probe_bytes`], best of 5 passes.
pub fn measure_read_bandwidth(llc: Option<u64>) -> f64 {
    let team = crate::team::team();
    let words = (read_probe_bytes(llc) / 8) as usize;
    let buf: Vec<u64> = (0..words as u64).collect();
    let per = words.div_ceil(team.threads() * 4).max(1);
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        team.run(words.div_ceil(per), &|i| {
            let c = &buf[i * per..((i + 1) * per).min(words)];
            std::hint::black_box(c.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
        });
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64());
    }
    best
}
