//! A model of the agent protocol (docs/architecture.md, "The agent protocol"), driven through
//! thousands of random interleavings of crashes: the coordinator and the agent each die at any
//! step (losing everything not durable), connections drop with messages in flight, jobs start,
//! print and end in between.
//!
//! The agent side is the real thing — its [`Outbox`], its journal's [`recover`] — and so is
//! the coordinator's [`reconcile`]; the coordinator's store and the effects of each event
//! (start: compare-and-set; result: ends an active job once; lines: stored once by number) are
//! modelled as the scheduler and the store implement them.
//!
//! The agent's journal may also be damaged when it dies (emptied, cut): the real agent then
//! refuses to start until an operator resets the journal, and connects saying its journal is
//! incomplete until the coordinator has welcomed it. Modelled as a reset.
//!
//! Checked: no job's process ever starts twice; once the crashes stop, every job ends, every
//! job that ran has its start time, and every job that succeeded has every line it printed,
//! once, in order.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_agent::journal::{records_for, recover, Record};
use gpuci_agent::outbox::Outbox;
use gpuci_coordinator::brain::reconcile;
use gpuci_core::job::{JobState, Outcome};
use gpuci_protocol::agent::{JobEvent, JobFinished, LogChunk, Stream};
use gpuci_protocol::JobId;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Lines each job prints.
const LINES: u64 = 6;

const LOST_NOTICE: &str = "gpuci: lines lost with the agent";

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What the coordinator's store holds for a job.
#[derive(Clone, Debug)]
struct StoredJob {
    state: JobState,
    started: bool,
    /// Log lines by number.
    log: BTreeMap<u64, String>,
}

enum ToAgent {
    Welcome { forget: Vec<JobId> },
    Assign(JobId),
    Acked(u64),
}

enum ToCoordinator {
    /// What the agent holds, and whether its journal is incomplete.
    Hello(Vec<JobId>, bool),
    Event(u64, JobEvent),
}

/// A job's process on the agent's host: prints its lines, then exits 0.
struct Process {
    printed: u64,
}

struct Agent {
    /// Durable: survives the agent's death.
    journal: Vec<Record>,
    outbox: Outbox,
    holds: BTreeSet<JobId>,
    running: BTreeMap<JobId, Process>,
    /// Durable (the journal's header): reset since the coordinator last welcomed it.
    incomplete: bool,
}

impl Agent {
    fn start(journal: Vec<Record>, incomplete: bool) -> Agent {
        // As `gpuci_agent::run`: recover what is owed, rewrite the journal with it.
        let owed = recover(&journal, 0);
        let mut a = Agent {
            journal: records_for(&owed),
            outbox: Outbox::new(1 << 20),
            holds: BTreeSet::new(),
            running: BTreeMap::new(),
            incomplete,
        };
        for (job, events) in owed {
            a.holds.insert(job);
            for e in events {
                a.outbox.push(e);
            }
        }
        a
    }
}

struct World {
    rng: Rng,
    jobs: BTreeMap<JobId, StoredJob>,
    agent: Agent,
    /// The coordinator's view of the connection: up (welcomed) or not.
    connected: bool,
    to_agent: VecDeque<ToAgent>,
    to_coord: VecDeque<ToCoordinator>,
    /// Outside gpuci: how often each job's process started.
    ledger: BTreeMap<JobId, u32>,
    /// How often the agent's journal was damaged and reset.
    resets: u32,
}

impl World {
    fn new(seed: u64, jobs: i64) -> World {
        World {
            rng: Rng(seed | 1),
            jobs: (1..=jobs)
                .map(|id| (id, StoredJob { state: JobState::Queued, started: false, log: BTreeMap::new() }))
                .collect(),
            agent: Agent::start(Vec::new(), false),
            connected: false,
            to_agent: VecDeque::new(),
            to_coord: VecDeque::new(),
            ledger: BTreeMap::new(),
            resets: 0,
        }
    }

    fn drop_connection(&mut self) {
        self.connected = false;
        self.to_agent.clear();
        self.to_coord.clear();
        self.agent.outbox.rewind();
    }

    fn connect(&mut self) {
        self.drop_connection();
        self.to_coord
            .push_back(ToCoordinator::Hello(self.agent.holds.iter().copied().collect(), self.agent.incomplete));
    }

    /// The coordinator takes one message from the agent.
    fn coordinator_receives(&mut self) {
        let Some(m) = self.to_coord.pop_front() else { return };
        match m {
            ToCoordinator::Hello(holds, incomplete) => {
                let ours: Vec<(JobId, JobState)> = self
                    .jobs
                    .iter()
                    .filter(|(_, j)| matches!(j.state, JobState::Assigned | JobState::Running))
                    .map(|(id, j)| (*id, j.state))
                    .collect();
                let plan = reconcile(&ours, &holds, incomplete, &[]);
                for id in plan.requeue {
                    self.jobs.get_mut(&id).unwrap().state = JobState::Queued;
                }
                for id in plan.lost {
                    self.jobs.get_mut(&id).unwrap().state = JobState::Lost;
                }
                self.connected = true;
                self.to_agent.push_back(ToAgent::Welcome { forget: plan.forget });
            }
            ToCoordinator::Event(n, e) => {
                if !self.connected {
                    return;
                }
                let job = self.jobs.get_mut(&e.job_id()).unwrap();
                match e {
                    JobEvent::Started { .. } => {
                        if job.state == JobState::Assigned {
                            job.state = JobState::Running;
                            job.started = true;
                        }
                    }
                    JobEvent::Log { first_seq, lines, .. } => {
                        let last = job.log.keys().next_back().copied().unwrap_or(0);
                        for (i, l) in lines.into_iter().enumerate() {
                            let seq = first_seq + i as u64;
                            if seq > last {
                                job.log.insert(seq, l.text);
                            }
                        }
                    }
                    JobEvent::Finished(f) => {
                        // As the channel does: lines the result counts and the log lacks died
                        // with the agent; one gpuci line says so where they were.
                        let last = job.log.keys().next_back().copied().unwrap_or(0);
                        if matches!(job.state, JobState::Assigned | JobState::Running)
                            && f.lines.is_some_and(|l| l > last)
                        {
                            job.log.insert(last + 1, LOST_NOTICE.into());
                        }
                        if matches!(job.state, JobState::Assigned | JobState::Running) {
                            if f.started_at_us.is_some() {
                                job.started = true;
                            }
                            job.state = f.outcome.verdict().0;
                        }
                    }
                }
                self.to_agent.push_back(ToAgent::Acked(n));
            }
        }
    }

    /// The agent takes one message from the coordinator.
    fn agent_receives(&mut self) {
        let Some(m) = self.to_agent.pop_front() else { return };
        let a = &mut self.agent;
        match m {
            ToAgent::Welcome { forget } => {
                a.incomplete = false;
                for id in forget {
                    // Cancelled: the process is killed; its result follows.
                    if a.running.remove(&id).is_some() {
                        finish(a, id, Outcome::Cancelled { reason: "forgotten".into() });
                    }
                }
            }
            ToAgent::Assign(id) => {
                if a.holds.insert(id) {
                    a.journal.push(Record::Received { job_id: id, at_us: 1 });
                    a.running.insert(id, Process { printed: 0 });
                    *self.ledger.entry(id).or_default() += 1;
                    a.journal.push(Record::Started { job_id: id, pid: 1, started_at_us: 1, unenforced: vec![] });
                    a.outbox.push(JobEvent::Started { job_id: id, pid: 1, started_at_us: 1, unenforced: vec![] });
                }
            }
            ToAgent::Acked(upto) => {
                for id in a.outbox.ack(upto) {
                    a.holds.remove(&id);
                    a.journal.push(Record::Done { job_id: id });
                }
            }
        }
    }

    /// The coordinator places a queued job: `assigned` is committed, then the assignment sent.
    fn coordinator_assigns(&mut self, chaos: bool) {
        if !self.connected {
            return;
        }
        if let Some((id, j)) = self.jobs.iter_mut().find(|(_, j)| j.state == JobState::Queued) {
            j.state = JobState::Assigned;
            let id = *id;
            if chaos && self.rng.chance(10) {
                // The coordinator dies between the commit and the push.
                self.drop_connection();
            } else {
                self.to_agent.push_back(ToAgent::Assign(id));
            }
        }
    }

    fn step(&mut self, chaos: bool) {
        match self.rng.below(100) {
            0..=24 => self.coordinator_receives(),
            25..=44 => self.agent_receives(),
            45..=54 => self.coordinator_assigns(chaos),
            55..=79 => {
                // A job prints a line, or ends.
                let ids: Vec<JobId> = self.agent.running.keys().copied().collect();
                if ids.is_empty() {
                    return;
                }
                let id = ids[self.rng.below(ids.len() as u64) as usize];
                let a = &mut self.agent;
                let p = a.running.get_mut(&id).unwrap();
                if p.printed < LINES {
                    p.printed += 1;
                    let text = format!("job {id} line {}", p.printed);
                    a.outbox.push_lines(id, vec![LogChunk { ts_us: 1, stream: Stream::Stdout, text }]);
                } else {
                    a.running.remove(&id);
                    finish(a, id, Outcome::Exited { code: 0 });
                }
            }
            // The agent sends what it has not sent on this connection.
            80..=91 if self.connected => {
                for (n, e) in self.agent.outbox.to_send() {
                    self.to_coord.push_back(ToCoordinator::Event(n, e));
                }
            }
            92..=94 if !self.connected && self.to_coord.is_empty() => self.connect(),
            95 if chaos => {
                // The agent dies: its processes die with it; the journal is all that is left.
                let mut journal = std::mem::take(&mut self.agent.journal);
                let mut incomplete = self.agent.incomplete;
                if self.rng.chance(20) {
                    // ...and its journal was damaged: the operator resets it.
                    journal.clear();
                    incomplete = true;
                    self.resets += 1;
                }
                self.agent = Agent::start(journal, incomplete);
                self.drop_connection();
            }
            96 if chaos => {
                // The coordinator dies: only its store is left.
                self.drop_connection();
            }
            97 if chaos => self.drop_connection(),
            _ => {}
        }
    }

    fn settled(&self) -> bool {
        self.jobs.values().all(|j| j.state.is_terminal())
    }
}

fn finish(a: &mut Agent, id: JobId, outcome: Outcome) {
    let mut f = JobFinished {
        job_id: id,
        outcome,
        finished_at_us: 2,
        started_at_us: Some(1),
        lines: None,
        telemetry: None,
        gpu_health: Default::default(),
    };
    f.lines = Some(a.outbox.lines_of(id));
    a.journal.push(Record::Finished(f.clone()));
    a.outbox.push(JobEvent::Finished(f));
}

#[test]
fn no_interleaving_of_crashes_runs_a_job_twice_or_loses_one_or_its_lines() {
    let runs: u64 = std::env::var("GPUCI_MODEL_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3000);
    let (mut lost, mut noticed, mut given_up) = (0, 0, 0);
    for seed in 1..=runs {
        let mut w = World::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), 6);
        for _ in 0..400 {
            w.step(true);
        }
        // The crashes stop: everything must settle.
        let mut steps = 0;
        while !w.settled() {
            w.step(false);
            steps += 1;
            assert!(steps < 200_000, "seed {seed}: never settled: {:?}", w.jobs);
        }
        for (id, n) in &w.ledger {
            assert!(*n <= 1, "seed {seed}: job {id} started {n} times");
        }
        for (id, j) in &w.jobs {
            let ran = w.ledger.contains_key(id);
            match j.state {
                JobState::Succeeded => {
                    assert!(j.started, "seed {seed}: job {id} succeeded without a start time");
                    // Every line, once, in order; or, where the agent died with the rest, the
                    // lines it had sent and then the notice.
                    let want: Vec<String> = (1..=LINES).map(|i| format!("job {id} line {i}")).collect();
                    let got: Vec<String> = j.log.values().cloned().collect();
                    let numbers: Vec<u64> = j.log.keys().copied().collect();
                    assert_eq!(numbers, (1..=got.len() as u64).collect::<Vec<_>>(), "seed {seed}: job {id}: {got:?}");
                    match got.iter().position(|l| l == LOST_NOTICE) {
                        None => assert_eq!(got, want, "seed {seed}: job {id}'s log"),
                        Some(at) => {
                            assert_eq!(at, got.len() - 1, "seed {seed}: job {id}: {got:?}");
                            assert_eq!(got[..at], want[..at], "seed {seed}: job {id}'s log");
                            noticed += 1;
                        }
                    }
                }
                JobState::Lost => {
                    lost += 1;
                    if !ran {
                        // Only a reset journal may cost a job that never started here: the
                        // coordinator cannot tell it from one that did.
                        assert!(
                            w.resets > 0,
                            "seed {seed}: job {id} lost without ever starting: it should have been requeued"
                        );
                        given_up += 1;
                    }
                }
                s => panic!("seed {seed}: job {id} ended {s}"),
            }
        }
    }
    // The model must actually reach the hard cases: jobs lost with their agent.
    assert!(lost > 0, "no run lost a job: the model never killed an agent mid-job");
    assert!(noticed > 0, "no run lost lines of a finished job: the model never killed an agent after a result");
    assert!(given_up > 0, "no run gave up a job after a journal reset: the model never reset one with jobs assigned");
    eprintln!("{runs} runs: {lost} jobs lost with their agent ({given_up} after a journal reset), {noticed} logs with lost lines noted");
}
