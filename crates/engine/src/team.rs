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

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A posted job: `tasks` calls of `f`, by index.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
}

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

/// A fixed team of worker threads for the step's data-parallel regions.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    busy: Mutex<()>,
    pinned: bool,
}

impl Team {
    /// A team of `threads` (the caller counts as one: `threads - 1` are spawned), each
    /// spawned thread pinned to one CPU of `cpus` when given; idle workers spin `spin`
    /// before they sleep.
    pub fn new(threads: usize, cpus: Option<&[usize]>, spin: Duration) -> Team {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                f: &NOTHING,
                tasks: 0,
            }),
            next: AtomicUsize::new(0),
            helpers: AtomicU64::new(0),
            sleep: Mutex::new(0),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            spin,
        });
        let mut workers = Vec::new();
        for w in 1..threads.max(1) {
            let s = shared.clone();
            // one thread a core: threads past the cores given stay unpinned
            let cpu = cpus.and_then(|c| c.get(w).copied());
            let h = std::thread::Builder::new()
                .name(format!("moelane-team-{w}"))
                .spawn(move || {
                    if let Some(c) = cpu {
                        pin_to(c);
                    }
                    worker(&s)
                });
            match h {
                Ok(h) => workers.push(h),
                // fewer threads than asked: the team still works, only slower
                Err(_) => break,
            }
        }
        Team {
            shared,
            workers,
            busy: Mutex::new(()),
            pinned: cpus.is_some_and(|c| !c.is_empty()),
        }
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
            };
        }
        s.next.store(0, Ordering::Relaxed);
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
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| claim(s, f, tasks)));
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

fn claim(s: &Shared, f: &(dyn Fn(usize) + Sync), tasks: usize) {
    loop {
        let t = s.next.fetch_add(1, Ordering::Relaxed);
        if t >= tasks {
            return;
        }
        f(t);
    }
}

fn worker(s: &Shared) {
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
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| claim(s, f, job.tasks)));
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

fn spin_time() -> Duration {
    let us = std::env::var("MOELANE_SPIN_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(200);
    Duration::from_micros(us)
}

#[cfg(target_os = "linux")]
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays inside it for
    // cpu < CPU_SETSIZE (checked); sched_setaffinity(0) affects this thread only.
    unsafe {
        if cpu >= libc::CPU_SETSIZE as usize {
            return;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to(_cpu: usize) {}

/// The CPUs this process may run on (its affinity mask), one per physical core (the
/// first hardware thread of each core), in order; None where that cannot be read.
pub fn physical_cpus() -> Option<Vec<usize>> {
    let allowed = allowed_cpus()?;
    let mut cores = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for &c in &allowed {
        let path = format!("/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list");
        let first = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| parse_cpu_list(s.trim()).into_iter().next())
            .unwrap_or(c);
        if cores.insert(first) {
            out.push(c);
        }
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(target_os = "linux")]
fn allowed_cpus() -> Option<Vec<usize>> {
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
fn allowed_cpus() -> Option<Vec<usize>> {
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
/// other work, unpinned threads move away from busy cores).
pub fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let phys = physical_cpus();
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
        Team::new(
            threads,
            if pin { phys.as_deref() } else { None },
            spin_time(),
        )
    })
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

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("5"), vec![5]);
        assert_eq!(parse_cpu_list("x,3-1,2"), vec![2]);
        assert!(physical_cpus().is_none_or(|c| !c.is_empty()));
    }
}
