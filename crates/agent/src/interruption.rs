//! The provider's notice that it takes the machine back: EC2 posts a spot interruption two
//! minutes ahead at `/latest/meta-data/spot/instance-action` in the instance metadata service
//! (404 until then; then `{"action": "terminate", "time": "…"}`). The agent looks every few
//! seconds and, once a notice is there, says so on [`watch`]'s channel: it then takes no new
//! job and tells the coordinator, which puts the jobs it runs back in the queue, once.
//!
//! IMDSv2 is used when the service offers it (a session token from `PUT /latest/api/token`),
//! IMDSv1 otherwise. The URL is configurable so tests (and other clouds) serve their own.

use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What a notice's body says, in words for the job's log and the machine's status.
pub fn describe(body: &str) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let field = |k: &str| parsed.as_ref().and_then(|v| v.get(k)).and_then(|v| v.as_str()).map(str::to_string);
    match (field("action"), field("time")) {
        (Some(a), Some(t)) => format!("spot interruption notice: {a} at {t}"),
        (Some(a), None) => format!("spot interruption notice: {a}"),
        _ => "spot interruption notice".to_string(),
    }
}

/// The token endpoint of an instance metadata service whose notice lives at `url`.
fn token_url(url: &str) -> Option<String> {
    let i = url.find("/latest/")?;
    Some(format!("{}/latest/api/token", &url[..i]))
}

/// Look once, now: an agent started on a machine already being taken back takes no job at all.
pub async fn check_once(url: &str) -> Option<String> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().ok()?;
    poll(&http, url).await.map(|body| describe(&body))
}

/// Look at `url` every `every` until a notice is there (then send it and stop) or `shutdown`.
pub async fn watch(url: String, every: Duration, notice: watch::Sender<Option<String>>, shutdown: CancellationToken) {
    let http = match reqwest::Client::builder().timeout(Duration::from_secs(2)).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch for interruption notices");
            return;
        }
    };
    tracing::info!(%url, "watching for the provider's interruption notice");
    loop {
        if let Some(body) = poll(&http, &url).await {
            let reason = describe(&body);
            let _ = notice.send(Some(reason));
            return;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// The notice's body if there is one now.
async fn poll(http: &reqwest::Client, url: &str) -> Option<String> {
    let mut req = http.get(url);
    if let Some(token_url) = token_url(url) {
        let token = http.put(token_url).header("X-aws-ec2-metadata-token-ttl-seconds", "300").send().await;
        if let Ok(t) = token {
            if t.status().is_success() {
                if let Ok(t) = t.text().await {
                    req = req.header("X-aws-ec2-metadata-token", t.trim());
                }
            }
        }
    }
    let resp = req.send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.text().await.ok().filter(|b| !b.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_read_as_words() {
        assert_eq!(
            describe(r#"{"action": "terminate", "time": "2026-11-24T08:22:00Z"}"#),
            "spot interruption notice: terminate at 2026-11-24T08:22:00Z"
        );
        assert_eq!(describe(r#"{"action": "stop"}"#), "spot interruption notice: stop");
        assert_eq!(describe("not json"), "spot interruption notice");
        assert_eq!(
            token_url("http://169.254.169.254/latest/meta-data/spot/instance-action").as_deref(),
            Some("http://169.254.169.254/latest/api/token")
        );
        assert_eq!(token_url("http://127.0.0.1:9/notice"), None);
    }
}
