//! Fan-out of live events to watchers (`logs -f`, `submit --wait`, `gpuci run`): job changes
//! and log lines. Slow watchers lag and re-read from the store; the hub never blocks a writer.

use gpuci_protocol::agent::TelemetryPoint;
use gpuci_protocol::api::{JobSummary, LogLine};
use gpuci_protocol::JobId;
use tokio::sync::broadcast;

#[derive(Clone, Debug)]
pub enum Event {
    Job(Box<JobSummary>),
    Log {
        job_id: JobId,
        pipeline_id: i64,
        line: LogLine,
    },
    /// A running job's GPUs together at one sampling tick.
    Telemetry {
        job_id: JobId,
        point: TelemetryPoint,
    },
}

pub struct Hub {
    tx: broadcast::Sender<Event>,
}

impl Default for Hub {
    fn default() -> Self {
        Self::new()
    }
}

impl Hub {
    pub fn new() -> Self {
        Hub { tx: broadcast::channel(16_384).0 }
    }
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
    pub fn job_changed(&self, j: JobSummary) {
        let _ = self.tx.send(Event::Job(Box::new(j)));
    }
    pub fn telemetry(&self, job_id: JobId, point: TelemetryPoint) {
        let _ = self.tx.send(Event::Telemetry { job_id, point });
    }
    pub fn log(&self, job_id: JobId, pipeline_id: i64, line: LogLine) {
        let _ = self.tx.send(Event::Log { job_id, pipeline_id, line });
    }
}
