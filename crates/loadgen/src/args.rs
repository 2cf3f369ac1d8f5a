//! The command line.

use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "gpuci-loadgen", about = "Thousands of simulated agents against one coordinator")]
pub struct Args {
    /// The coordinator, `http://HOST:PORT` (loopback: the agents connect from 127.0.0.0/8).
    #[arg(long)]
    pub server: String,
    #[arg(long, env = "GPUCI_REGISTRATION_TOKEN")]
    pub registration_token: String,
    /// A token that may submit pipelines.
    #[arg(long, env = "GPUCI_TOKEN")]
    pub api_token: String,
    #[arg(long, default_value_t = 1000)]
    pub agents: usize,
    /// GPUs (and job slots) per agent.
    #[arg(long, default_value_t = 4)]
    pub gpus: u32,
    /// Jobs queued before the agents take any (one GPU each).
    #[arg(long, default_value_t = 10_000)]
    pub jobs: usize,
    /// How long each job runs on its simulated agent (0: it ends as it starts). With a long
    /// time, placement is measured without the jobs' ends competing with it.
    #[arg(long, default_value_t = 0.0)]
    pub job_secs: f64,
    /// Steps per pipeline when queueing `--jobs`.
    #[arg(long, default_value_t = 100)]
    pub steps_per_pipeline: usize,
    /// Single-step pipelines submitted one by one, with free GPUs, for submit → assignment.
    #[arg(long, default_value_t = 200)]
    pub latency_samples: usize,
    /// The coordinator's pid, for its CPU and memory.
    #[arg(long)]
    pub coordinator_pid: Option<i32>,
    /// How long to watch the coordinator at rest (every agent connected and idle).
    #[arg(long, default_value_t = 20)]
    pub rest_secs: u64,
    /// Loopback source addresses to spread connections over (127.0.0.1, .2, ...): one address
    /// has about 28,000 ephemeral ports.
    #[arg(long, default_value_t = 8)]
    pub source_ips: u8,
    /// Registrations and connections in flight at once.
    #[arg(long, default_value_t = 128)]
    pub concurrency: usize,
    /// Run this (`sh -c`) after the other phases: it should kill the coordinator and start it
    /// again on the same address; measured: until every agent is connected again.
    #[arg(long)]
    pub storm_cmd: Option<String>,
    /// The new coordinator's pid is in this file after `--storm-cmd` (for its memory).
    #[arg(long)]
    pub storm_pid_file: Option<std::path::PathBuf>,
}
