//! gpuci-loadgen: measures one coordinator under thousands of agents (issue 29, item 5).
//!
//! It registers `--agents` simulated agents with `--gpus` GPUs each, connects them all over
//! the real agent protocol, and then measures, printing one JSON summary on stdout (progress
//! on stderr): the time to connect them; the coordinator's CPU and memory at rest (from
//! `/proc/PID`, with `--coordinator-pid`); placements per second with `--jobs` jobs queued
//! before any agent takes one; submit → assignment latency with free GPUs; and, with
//! `--storm-cmd`, how long every agent takes to be connected again after the coordinator is
//! restarted (the command kills and starts it). Jobs run for `--job-secs` on the simulated
//! agents, doing nothing, so what is measured is the coordinator.
//!
//! What it must not do: be pointed at a coordinator anyone uses. The agents it registers stay
//! registered there, and it queues real jobs.

mod agent;
mod args;
mod proc_stats;
mod run;

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run::run(args::Args::parse()).await
}
