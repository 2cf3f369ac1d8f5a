//! gpuci-protocol: the types that cross a process boundary — the REST API's bodies and the
//! messages on the agent channel — shared by coordinator, agent and CLI.
//!
//! Rules: plain serde data only, no behaviour beyond small helpers; every change that an
//! older peer could not read bumps [`PROTOCOL_VERSION`]. Must not depend on tokio, axum,
//! the store or anything with effects.

pub mod agent;
pub mod api;

/// Version of the agent channel. The coordinator refuses agents that speak another one.
/// 2: numbered job events acknowledged cumulatively (`Event`/`Acked`), log lines numbered per
/// job, `Hello::running` lists every job the agent holds.
/// 3: `Paused` (an agent whose disk is nearly full takes no new jobs), `Hello::paused` and
/// `Hello::journal_incomplete`.
/// 4: `Outcome::ArtifactsLost` (a step whose artifacts could not be stored fails).
pub const PROTOCOL_VERSION: u32 = 4;

/// The oldest agent protocol a coordinator still takes: during a rolling upgrade the
/// coordinators go first and the agents follow (docs/ha.md), so a coordinator must take the
/// agents of the version before it. An older agent sends nothing a newer coordinator cannot
/// read (4 added an outcome only agents send), and the coordinator sends it nothing new.
pub const OLDEST_AGENT_PROTOCOL: u32 = 3;

/// How long an agent waits without any frame from the coordinator (pongs included) before it
/// drops the connection and looks for the leader again: three heartbeat intervals, at least
/// 10 s. It checks once a heartbeat, so it leaves up to one interval later than this.
pub fn agent_silence_limit(heartbeat: std::time::Duration) -> std::time::Duration {
    (heartbeat * 3).max(std::time::Duration::from_secs(10))
}

/// How long a coordinator taking over must wait before it may call an agent lost, for
/// `heartbeat`: an agent still attached to a frozen former leader leaves it after
/// [`agent_silence_limit`] and one more interval, and reconnects within a few seconds. A
/// shorter `lost_after` on a standby ends running jobs `lost` that then run to their end.
pub fn least_lost_after_for_takeover(heartbeat: std::time::Duration) -> std::time::Duration {
    agent_silence_limit(heartbeat) + heartbeat + std::time::Duration::from_secs(5)
}

/// How long the coordinator keeps a connection open waiting for a request head: from the
/// connection's start, and between two requests on a kept-alive connection. A client that
/// finishes no request in that time is closed (a slow client cannot hold connections).
pub const REQUEST_HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long gpuci's own clients keep an idle connection to the coordinator for reuse: well
/// under [`REQUEST_HEAD_TIMEOUT`], so a request is never sent on a connection the
/// coordinator is closing as idle at that moment.
pub const CLIENT_POOL_IDLE: std::time::Duration = std::time::Duration::from_secs(20);

/// Whether a coordinator of this build takes an agent that speaks `version`.
pub fn takes_agent(version: u32) -> bool {
    (OLDEST_AGENT_PROTOCOL..=PROTOCOL_VERSION).contains(&version)
}

/// Job ids are small integers people can type (`gpuci logs 42`).
pub type JobId = i64;
pub type PipelineId = i64;

#[cfg(test)]
mod tests {
    /// Coordinators upgraded before their agents keep them: the version before is taken, a
    /// newer one (an agent upgraded first) and a much older one are refused.
    #[test]
    fn a_coordinator_takes_agents_of_the_version_before() {
        assert!(super::takes_agent(super::PROTOCOL_VERSION));
        assert!(super::takes_agent(super::PROTOCOL_VERSION - 1));
        assert!(!super::takes_agent(super::PROTOCOL_VERSION + 1));
        assert!(!super::takes_agent(2));
    }
}
