//! The dashboard's pages: HTML rendered on the server from plain data (job summaries, agents,
//! fleets, the cost report), with one small script of our own for live updates and log search,
//! and one stylesheet, both embedded. No I/O, no clock reads but what the caller passes (`now`):
//! the coordinator gathers the data, checks who may see it, and serves what this returns.
//!
//! Everything a job controls (its log, its step's name, its reason) is text, escaped by
//! `maud`; colours in logs become classes ([`ansi`]). Pages work without the script (forms post,
//! links navigate); the script only makes them live.

pub mod ansi;
mod audit;
mod builds;
mod chart;
mod gpu_ids;
mod pages;
mod pipeline;
mod schedules;

pub use audit::*;
pub use builds::{builds, trigger, BuildRow};
pub use gpu_ids::short_gpu_ids;
pub use pages::*;
pub use pipeline::{graph, layout_graph, pipeline, Node, PipelinePage};
pub use schedules::schedules;

/// The stylesheet, served at [`CSS_PATH`].
pub const CSS: &str = include_str!("../assets/gpuci.css");
/// The script, served at [`JS_PATH`].
pub const JS: &str = include_str!("../assets/gpuci.js");
/// Paths carry a version so a new binary's assets are never mixed with an old cache.
pub const CSS_PATH: &str = concat!("/ui/assets/gpuci-", env!("CARGO_PKG_VERSION"), ".css");
pub const JS_PATH: &str = concat!("/ui/assets/gpuci-", env!("CARGO_PKG_VERSION"), ".js");
