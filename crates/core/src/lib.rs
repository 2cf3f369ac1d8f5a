//! gpuci-core: the rules of the product as pure functions over plain data.
//!
//! What lives here: the pipeline format (`.gpuci.yml`) and its validation, durations and
//! quantities, the job state machine, job output as text (escaping, secret masking), GPU
//! facts and requirements, placement (which job goes to which host and which GPU UUIDs),
//! cache scopes (which caches a job may read and write), repository identities (`repo`: a
//! repository is named with its host; a bare `owner/name` in configs and stored data means
//! that repository on the configured GitHub host) and concurrency groups (scoped per
//! repository and trust class unless the server config shares one), and how a pipeline's jobs
//! combine (`progress`: soft failures, dependency gates, the pipeline's state), and which
//! workspace uploads may be garbage-collected (`uploads`), and the rules of artifacts
//! (`artifacts`: patterns, paths, caps, retention), and when cron schedules fire (`schedule`,
//! with the server config's `[[schedule]]` in `schedule_config`), and which of several
//! coordinators an agent or the CLI talks to (`coordinators`: the one whose `/readyz` says it
//! leads), and the scheduler's reaper, requeue and budget-hold decisions (`reap`: lost agents
//! and queue timeouts; `requeue`: retries and jobs on machines taken back; `reconnect`: an
//! agent's jobs when it connects; `budget_hold`).
//!
//! What must not live here: I/O of any kind (files, sockets, clocks, environment), an async
//! runtime, logging side effects. Callers hand in the current time and the observed state;
//! functions hand back decisions. That keeps the core exhaustively testable.

pub mod artifacts;
pub mod audit;
pub mod budget_hold;
pub mod builds;
pub mod cache;
pub mod concurrency;
pub mod condition;
pub mod coordinator_identity;
pub mod coordinators;
pub mod duration;
pub mod fleet;
pub mod gpu;
pub mod image;
pub mod job;
pub mod log_sections;
pub mod mask;
pub mod pipeline;
pub mod placement;
pub mod progress;
pub mod quantity;
pub mod reap;
pub mod reconnect;
pub mod repo;
pub mod requeue;
pub mod rerun;
pub mod schedule;
pub mod schedule_config;
pub mod secret_scope;
pub mod test_report;
pub mod text;
pub mod trust;
pub mod uploads;

pub use duration::Duration;
