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
pub const PROTOCOL_VERSION: u32 = 3;

/// Job ids are small integers people can type (`gpuci logs 42`).
pub type JobId = i64;
pub type PipelineId = i64;
