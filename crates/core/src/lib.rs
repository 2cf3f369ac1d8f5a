//! gpuci-core: the rules of the product as pure functions over plain data.
//!
//! What lives here: the pipeline format (`.gpuci.yml`) and its validation, durations and
//! quantities, the job state machine, job output as text (escaping, secret masking), GPU
//! facts and requirements, placement (which job goes to which host and which GPU UUIDs), and
//! cache scopes (which caches a job may read and write).
//!
//! What must not live here: I/O of any kind (files, sockets, clocks, environment), an async
//! runtime, logging side effects. Callers hand in the current time and the observed state;
//! functions hand back decisions. That keeps the core exhaustively testable.

pub mod cache;
pub mod duration;
pub mod fleet;
pub mod gpu;
pub mod image;
pub mod job;
pub mod mask;
pub mod pipeline;
pub mod placement;
pub mod quantity;
pub mod secret_scope;
pub mod text;
pub mod trust;

pub use duration::Duration;
