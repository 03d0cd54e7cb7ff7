//! Exhaustive model check of the two-phase swap protocol: every interleaving of a coordinator
//! (with its primary), a sidecar running the real transitions of `protocol::TierEpochs`, and a
//! network that loses, duplicates and reorders messages, with crashes and restarts of either
//! party, within small budgets. Checked in every reachable state:
//! - a data message is only ever computed with the map its sender computed the rest of the
//!   step with (every pick exactly once; the sidecar's staged maps are only ever ones it loaded
//!   for that very attempt);
//! - when everything has settled (no message in flight, no load running, coordinator idle and
//!   registered), both tiers serve one committed map, and it is the persisted one;
//! - from every settled state a swap can still commit (the protocol never wedges).
//!
//! Maps are identified by a content id distinct from their epoch, so that two maps sharing an
//! epoch (across coordinator incarnations) would be caught if they were ever confused.

use std::collections::{HashSet, VecDeque};

use moelane_residency_actor::protocol::{PrepareStep, ReleaseStep, TierEpochs};

type Content = u8;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Msg {
    // coordinator -> sidecar
    Prepare {
        inc: u8,
        base: u64,
        epoch: u64,
        content: Content,
    },
    Release {
        inc: u8,
        epoch: u64,
    },
    Abort {
        inc: u8,
        epoch: u64,
    },
    Register {
        inc: u8,
        epoch: u64,
        content: Content,
    },
    // primary -> sidecar: one layer of a step, tagged with the primary's epoch
    Data {
        inc: u8,
        tag: u64,
        content: Content,
    },
    // sidecar -> coordinator
    Prepared {
        inc: u8,
        epoch: u64,
    },
    Registered {
        inc: u8,
        highest: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// Waiting for REGISTER's answer (at start and after a crash, and to resync a sidecar).
    Registering,
    Idle,
    Preparing {
        epoch: u64,
        content: Content,
    },
    /// COMMIT done (the primary computes with the new map), not yet persisted.
    Committed,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Coord {
    inc: u8,
    phase: Phase,
    epoch: u64,
    content: Content,
    persisted: (u64, Content),
    attempted: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Side {
    t: TierEpochs,
    map: Content,
    next: Option<Content>,
    /// PREPAREs whose experts are loading (checked on arrival, staged later).
    loading: Vec<(u8, u64, u64, Content)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    c: Coord,
    s: Side,
    net: Vec<Msg>,
    next_content: Content,
    attempts: u8,
    losses: u8,
    dups: u8,
    coord_crashes: u8,
    side_crashes: u8,
    registers: u8,
}

struct Budget {
    registers: u8,
    attempts: u8,
    losses: u8,
    dups: u8,
    coord_crashes: u8,
    side_crashes: u8,
    net: usize,
}

impl State {
    fn init() -> State {
        State {
            c: Coord {
                inc: 1,
                phase: Phase::Registering,
                epoch: 0,
                content: 0,
                persisted: (0, 0),
                attempted: 0,
            },
            s: Side {
                t: TierEpochs::new(0),
                map: 0,
                next: None,
                loading: vec![],
            },
            net: vec![Msg::Register {
                inc: 1,
                epoch: 0,
                content: 0,
            }],
            next_content: 1,
            attempts: 0,
            losses: 0,
            dups: 0,
            coord_crashes: 0,
            side_crashes: 0,
            registers: 1,
        }
    }

    fn send(&mut self, m: Msg) {
        self.net.push(m);
        self.net.sort();
    }

    fn settled(&self) -> bool {
        self.net.is_empty()
            && self.s.loading.is_empty()
            && self.c.phase == Phase::Idle
            && self.s.t.incarnation == self.c.inc as u64
    }
}

/// The map content the sidecar would compute a message tagged `tag` with, if any.
fn resolve(s: &Side, tag: u64) -> Option<Content> {
    if !s.t.serves(tag) {
        return None;
    }
    if tag == s.t.epoch {
        Some(s.map)
    } else {
        s.next
    }
}

/// The sidecar handles one message; may answer.
fn sidecar_receive(st: &mut State, m: Msg) -> Result<(), String> {
    let s = &mut st.s;
    match m {
        Msg::Prepare {
            inc,
            base,
            epoch,
            content,
        } => {
            if let Ok(step) = s.t.check_prepare(inc as u64, base, epoch) {
                if step == PrepareStep::AlreadyStaged {
                    st.send(Msg::Prepared { inc, epoch });
                } else if !s.loading.contains(&(inc, base, epoch, content)) {
                    s.loading.push((inc, base, epoch, content));
                    s.loading.sort();
                }
            }
        }
        Msg::Release { inc, epoch } => {
            if let Ok(ReleaseStep::Promote) = s.t.release(inc as u64, epoch) {
                s.map = s.next.take().ok_or("promoted with nothing staged")?;
            }
        }
        Msg::Abort { inc, epoch } => {
            if let Ok(true) = s.t.abort(inc as u64, epoch) {
                s.next = None;
            }
        }
        Msg::Register {
            inc,
            epoch,
            content,
        } => {
            if s.t.check_register(inc as u64).is_err() {
                return Ok(());
            }
            let highest = s.t.highest();
            // contents compared, as the sidecar compares maps: keep, promote or reload
            s.map = content;
            s.next = None;
            s.t.register(inc as u64, epoch);
            st.send(Msg::Registered { inc, highest });
        }
        Msg::Data { tag, content, .. } => {
            if let Some(used) = resolve(s, tag) {
                if used != content {
                    return Err(format!(
                        "step tagged {tag} computed with map {used}, its sender used {content}"
                    ));
                }
            }
        }
        _ => unreachable!(),
    }
    Ok(())
}

fn coordinator_receive(st: &mut State, m: Msg) {
    let c = &mut st.c;
    match m {
        Msg::Prepared { inc, epoch } => {
            if inc == c.inc {
                if let Phase::Preparing { epoch: e, content } = c.phase {
                    if e == epoch {
                        // COMMIT to the primary
                        c.epoch = e;
                        c.content = content;
                        c.phase = Phase::Committed;
                    }
                }
            }
        }
        Msg::Registered { inc, highest } => {
            if inc == c.inc && c.phase == Phase::Registering {
                c.attempted = c.attempted.max(highest);
                c.phase = Phase::Idle;
            }
        }
        _ => unreachable!(),
    }
}

fn successors(st: &State, b: &Budget) -> Result<Vec<State>, String> {
    let mut out = Vec::new();
    // the network: deliver (any order), lose, duplicate
    let mut seen = HashSet::new();
    for i in 0..st.net.len() {
        if !seen.insert(&st.net[i]) {
            continue;
        }
        let mut n = st.clone();
        let m = n.net.remove(i);
        match m {
            Msg::Prepared { .. } | Msg::Registered { .. } => coordinator_receive(&mut n, m.clone()),
            _ => sidecar_receive(&mut n, m.clone()).map_err(|e| format!("{e}\nin {st:?}"))?,
        }
        out.push(n);
        if st.losses < b.losses {
            let mut n = st.clone();
            n.net.remove(i);
            n.losses += 1;
            out.push(n);
        }
        if st.dups < b.dups && st.net.len() < b.net {
            let mut n = st.clone();
            n.send(m);
            n.dups += 1;
            out.push(n);
        }
    }
    // a load finishes: re-checked under the lock, staged, answered
    for i in 0..st.s.loading.len() {
        let mut n = st.clone();
        let (inc, base, epoch, content) = n.s.loading.remove(i);
        if let Ok(step) = n.s.t.check_prepare(inc as u64, base, epoch) {
            match step {
                PrepareStep::PromoteThenStage => {
                    n.s.map = n.s.next.take().ok_or("promote with nothing staged")?;
                }
                PrepareStep::DropThenStage => n.s.next = None,
                PrepareStep::Stage | PrepareStep::AlreadyStaged => {}
            }
            if step != PrepareStep::AlreadyStaged {
                n.s.next = Some(content);
            }
            n.s.t.apply_prepare(step, epoch);
            n.send(Msg::Prepared { inc, epoch });
        }
        out.push(n);
    }
    let room = st.net.len() < b.net;
    // the coordinator
    match st.c.phase.clone() {
        Phase::Idle if st.attempts < b.attempts && room => {
            let mut n = st.clone();
            let epoch = n.c.attempted.max(n.c.epoch) + 1;
            n.c.attempted = epoch;
            let content = n.next_content;
            n.next_content += 1;
            n.attempts += 1;
            n.c.phase = Phase::Preparing { epoch, content };
            let (inc, base) = (n.c.inc, n.c.epoch);
            n.send(Msg::Prepare {
                inc,
                base,
                epoch,
                content,
            });
            out.push(n);
        }
        Phase::Preparing { epoch, .. } if room => {
            // timeout (or an error answer): ABORT
            let mut n = st.clone();
            n.c.phase = Phase::Idle;
            let inc = n.c.inc;
            n.send(Msg::Abort { inc, epoch });
            out.push(n);
        }
        Phase::Committed if room => {
            // persist, then RELEASE
            let mut n = st.clone();
            n.c.persisted = (n.c.epoch, n.c.content);
            n.c.phase = Phase::Idle;
            let (inc, epoch) = (n.c.inc, n.c.epoch);
            n.send(Msg::Release { inc, epoch });
            out.push(n);
        }
        Phase::Registering if room && st.registers < b.registers => {
            // REGISTER timed out: again, under a new token
            let mut n = st.clone();
            n.registers += 1;
            n.c.inc += 1;
            let (inc, epoch, content) = (n.c.inc, n.c.persisted.0, n.c.persisted.1);
            n.send(Msg::Register {
                inc,
                epoch,
                content,
            });
            out.push(n);
        }
        _ => {}
    }
    // the health probe sees a sidecar that restarted: resync (between swaps)
    if st.c.phase == Phase::Idle
        && st.s.t.incarnation != st.c.inc as u64
        && room
        && st.registers < b.registers
    {
        let mut n = st.clone();
        n.registers += 1;
        n.c.inc += 1;
        n.c.phase = Phase::Registering;
        let (inc, epoch, content) = (n.c.inc, n.c.epoch, n.c.content);
        n.send(Msg::Register {
            inc,
            epoch,
            content,
        });
        out.push(n);
    }
    // the primary computes a step (one data message in flight at most)
    if matches!(st.c.phase, Phase::Idle | Phase::Preparing { .. })
        && !st.net.iter().any(|m| matches!(m, Msg::Data { .. }))
        && room
    {
        let mut n = st.clone();
        let (inc, tag, content) = (n.c.inc, n.c.epoch, n.c.content);
        n.send(Msg::Data { inc, tag, content });
        out.push(n);
    }
    // crashes: the coordinator restarts from its persisted map as a new incarnation (its
    // data link died with it; control messages it sent may still arrive); the sidecar restarts
    // from its own stale map file (epoch 0), unregistered, its links and loads gone
    if st.coord_crashes < b.coord_crashes && st.registers < b.registers {
        let mut n = st.clone();
        n.coord_crashes += 1;
        n.registers += 1;
        let inc = n.c.inc + 1;
        n.net.retain(|m| {
            !matches!(
                m,
                Msg::Data { .. } | Msg::Prepared { .. } | Msg::Registered { .. }
            )
        });
        let (epoch, content) = n.c.persisted;
        n.c = Coord {
            inc,
            phase: Phase::Registering,
            epoch,
            content,
            persisted: (epoch, content),
            attempted: epoch,
        };
        n.send(Msg::Register {
            inc,
            epoch,
            content,
        });
        out.push(n);
    }
    if st.side_crashes < b.side_crashes {
        let mut n = st.clone();
        n.side_crashes += 1;
        // requests to it die with their connections; answers it sent may still arrive
        n.net
            .retain(|m| matches!(m, Msg::Prepared { .. } | Msg::Registered { .. }));
        n.s = Side {
            t: TierEpochs::new(0),
            map: 0,
            next: None,
            loading: vec![],
        };
        out.push(n);
    }
    Ok(out)
}

/// From a settled state, with no more faults, a swap commits.
fn a_swap_commits(st: &State) -> bool {
    let mut n = st.clone();
    let b = Budget {
        registers: st.registers,
        attempts: st.attempts + 1,
        losses: st.losses,
        dups: st.dups,
        coord_crashes: st.coord_crashes,
        side_crashes: st.side_crashes,
        net: 6,
    };
    // propose, then deliver everything in order until idle again
    for _ in 0..16 {
        if n.attempts == b.attempts && n.settled() {
            return n.c.epoch > st.c.epoch && resolve(&n.s, n.c.epoch) == Some(n.c.content);
        }
        let succ = match successors(&n, &b) {
            Ok(s) => s,
            Err(_) => return false,
        };
        // prefer: deliver the first message, finish a load, then coordinator progress
        let pick = succ.into_iter().find(|x| {
            x.losses == n.losses
                && x.dups == n.dups
                && x.coord_crashes == n.coord_crashes
                && x.side_crashes == n.side_crashes
                && !x.net.iter().any(|m| matches!(m, Msg::Data { .. }))
                && !matches!(x.c.phase, Phase::Idle if matches!(n.c.phase, Phase::Preparing { .. }))
        });
        match pick {
            Some(x) => n = x,
            None => return false,
        }
    }
    false
}

fn explore(b: Budget) -> usize {
    let mut seen = HashSet::new();
    let mut q = VecDeque::new();
    let s0 = State::init();
    seen.insert(s0.clone());
    q.push_back(s0);
    while let Some(st) = q.pop_front() {
        if st.settled() {
            assert_eq!(
                resolve(&st.s, st.c.epoch),
                Some(st.c.content),
                "settled, but the sidecar does not serve the primary's map: {st:?}"
            );
            assert_eq!(
                st.c.persisted,
                (st.c.epoch, st.c.content),
                "settled, but the persisted map is not the committed one: {st:?}"
            );
            assert!(
                a_swap_commits(&st),
                "wedged: no swap can commit from {st:?}"
            );
        }
        for n in successors(&st, &b).unwrap_or_else(|e| panic!("invariant broken: {e}")) {
            if seen.insert(n.clone()) {
                q.push_back(n);
            }
        }
    }
    seen.len()
}

#[test]
fn no_fault_sequence_breaks_the_invariants() {
    let n = explore(Budget {
        registers: 3,
        attempts: 2,
        losses: 1,
        dups: 1,
        coord_crashes: 1,
        side_crashes: 1,
        net: 4,
    });
    eprintln!("{n} states explored");
    assert!(n > 10_000, "suspiciously few states: {n}");
}

#[test]
fn more_message_faults_without_crashes() {
    let n = explore(Budget {
        registers: 1,
        attempts: 3,
        losses: 2,
        dups: 1,
        coord_crashes: 0,
        side_crashes: 0,
        net: 4,
    });
    eprintln!("{n} states explored");
}
