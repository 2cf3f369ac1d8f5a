//! Says loudly when a shared blob store (an S3 bucket) stops answering after the start. The
//! start itself refuses a bucket it cannot reach ([`crate::blobs::open`]); this covers the
//! hours after. Every [`EVERY`] it checks the bucket (`HeadBucket`, bounded by
//! `gpuci_aws::s3`'s timeouts) and logs an error when it stops answering, again every
//! [`REPEAT`] while it stays down, and once when it is back. It changes nothing: uploads
//! and downloads answer 503 on their own while the store is down (`crate::artifacts`), and
//! `/readyz` stays ready — scheduling and logs do not need the bucket, and a load balancer
//! pulling the only coordinator would stop those too.
//!
//! What to say is [`step`], a pure function of the last state, the clock and the result.

use crate::blobs::BlobStore;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the bucket is checked.
pub const EVERY: Duration = Duration::from_secs(60);
/// How often a store that stays down is reported again.
pub const REPEAT: Duration = Duration::from_secs(300);

/// What the watcher remembers between checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Watch {
    /// Since when the store has not answered (Unix ms), if it does not.
    pub down_since_ms: Option<i64>,
    /// When that was last reported.
    pub reported_ms: i64,
}

/// What to log after a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Say {
    Nothing,
    /// It stopped answering now.
    Down,
    /// Still down, for this long (ms): a reminder every [`REPEAT`].
    StillDown(i64),
    /// Answering again after this long down (ms).
    Back(i64),
}

/// The next state and what to say, after a check at `now_ms` that answered (`ok`) or not.
pub fn step(w: Watch, now_ms: i64, ok: bool) -> (Watch, Say) {
    let repeat_ms = i64::try_from(REPEAT.as_millis()).unwrap_or(i64::MAX);
    match (w.down_since_ms, ok) {
        (None, true) => (w, Say::Nothing),
        (None, false) => (Watch { down_since_ms: Some(now_ms), reported_ms: now_ms }, Say::Down),
        (Some(since), true) => (Watch::default(), Say::Back(now_ms.saturating_sub(since))),
        (Some(since), false) if now_ms.saturating_sub(w.reported_ms) >= repeat_ms => {
            (Watch { down_since_ms: Some(since), reported_ms: now_ms }, Say::StillDown(now_ms.saturating_sub(since)))
        }
        (Some(_), false) => (w, Say::Nothing),
    }
}

/// Checks `blobs` until `shutdown`; returns at once for a store that is not shared (the
/// local directory: its failures are the disk's, reported where they happen).
pub async fn run(blobs: Arc<dyn BlobStore>, shutdown: CancellationToken) {
    if !blobs.shared() {
        return;
    }
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The start checked it a moment ago.
    every.tick().await;
    let mut watch = Watch::default();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = blobs.check() => r,
        };
        let (next, say) = step(watch, crate::brain::now_ms(), result.is_ok());
        watch = next;
        let location = blobs.location();
        match (say, &result) {
            (Say::Down, Err(e)) => tracing::error!(
                %location, error = %e,
                "the blob store does not answer: uploads and artifacts are refused with 503 until it does"
            ),
            (Say::StillDown(ms), Err(e)) => tracing::error!(
                %location, error = %e, down_for_s = ms / 1000,
                "the blob store still does not answer: uploads and artifacts are refused with 503"
            ),
            (Say::Back(ms), _) => tracing::warn!(%location, down_for_s = ms / 1000, "the blob store answers again"),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_is_said_at_once_then_every_repeat_and_back_once() {
        let r = i64::try_from(REPEAT.as_millis()).unwrap_or(i64::MAX);
        let (w, say) = step(Watch::default(), 1_000, true);
        assert_eq!(say, Say::Nothing);
        let (w, say) = step(w, 2_000, false);
        assert_eq!(say, Say::Down);
        let (w, say) = step(w, 2_000 + r - 1, false);
        assert_eq!(say, Say::Nothing, "not again before the repeat");
        let (w, say) = step(w, 2_000 + r, false);
        assert_eq!(say, Say::StillDown(r));
        let (w, say) = step(w, 2_000 + r + 60_000, false);
        assert_eq!(say, Say::Nothing);
        let (w, say) = step(w, 2_000 + 2 * r, false);
        assert_eq!(say, Say::StillDown(2 * r));
        let (w, say) = step(w, 3_000 + 2 * r, true);
        assert_eq!((say, w), (Say::Back(1_000 + 2 * r), Watch::default()));
    }
}
