//! The job's pipes to the agent loop: bounded, capped, masked across cuts.
#![allow(clippy::unwrap_used)]
use super::output::*;
use super::*;
use tokio::io::AsyncWriteExt;

fn emitter(secrets: &[&str], max_log_bytes: u64) -> (Emitter, mpsc::UnboundedReceiver<JobEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Emitter::new(1, tx, Arc::new(JobMask::new(Masker::new(secrets.iter().copied()))), max_log_bytes), rx)
}

/// Everything queued now: (stream, text) per line.
fn queued(rx: &mut mpsc::UnboundedReceiver<JobEvent>) -> Vec<(Stream, String)> {
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        if let JobEvent::Log { chunk, .. } = ev {
            out.push((chunk.stream, chunk.text));
        }
    }
    out
}

/// A job that writes `total` bytes into a pipe; returns how far it got.
fn job_writing(total: usize, line: &'static [u8]) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<usize>) {
    let (pipe, mut job) = tokio::io::duplex(64 * 1024);
    let writer = tokio::spawn(async move {
        let mut written = 0;
        while written < total {
            if job.write_all(line).await.is_err() {
                break;
            }
            written += line.len();
        }
        written
    });
    (pipe, writer)
}

async fn settle() {
    for _ in 0..10_000 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_job_writing_faster_than_the_agent_forwards_waits_on_its_pipe() {
    // No log cap here (4 M lines would pass it): this is about the pipe, not the cap.
    let (out, mut rx) = emitter(&[], u64::MAX);
    let (pipe, writer) = job_writing(4_000_000 * 2, b"x\n");
    let reader = tokio::spawn(lines(out.clone(), Stream::Stdout, pipe));
    // Nobody forwards: the queue fills to the job's budget and the job stops on its pipe.
    settle().await;
    let lines_queued = rx.len();
    assert!(!writer.is_finished(), "the job wrote everything although nothing was forwarded");
    assert!(
        lines_queued * (1 + LINE_OVERHEAD) <= JOB_IN_FLIGHT_BYTES,
        "{lines_queued} lines queued: more than the in-flight budget of {JOB_IN_FLIGHT_BYTES} bytes"
    );
    // Forwarding (and so giving back the budget) lets the job go on to its end.
    let mut received = 0;
    while let Some(ev) = rx.recv().await {
        if let JobEvent::Log { .. } = ev {
            received += 1;
        }
        assert!(rx.len() * (1 + LINE_OVERHEAD) <= JOB_IN_FLIGHT_BYTES);
        if received == 4_000_000 {
            break;
        }
    }
    assert_eq!(writer.await.unwrap(), 8_000_000);
    reader.await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn output_past_the_cap_is_drained_and_the_log_ends_with_one_notice() {
    let (out, mut rx) = emitter(&[], 10_000);
    let (pipe, writer) = job_writing(1_000_000, b"0123456789abcdefghi\n");
    let reader = tokio::spawn(lines(out.clone(), Stream::Stdout, pipe));
    let mut log = Vec::new();
    while !reader.is_finished() {
        log.extend(queued(&mut rx));
        tokio::task::yield_now().await;
    }
    log.extend(queued(&mut rx));
    assert_eq!(writer.await.unwrap(), 1_000_000, "the job must be able to write all its output");
    let cost = gpuci_protocol::agent::log_line_cost;
    let job_bytes: u64 = log.iter().filter(|(s, _)| *s == Stream::Stdout).map(|(_, t)| cost(t)).sum();
    assert!(job_bytes <= 10_000, "{job_bytes} bytes kept past the cap");
    // Lines of 19 characters count 59 each: 169 fit.
    assert_eq!(job_bytes, 169 * 59, "lines up to the cap are kept");
    let (stream, notice) = log.last().unwrap();
    assert_eq!(*stream, Stream::System);
    assert!(
        notice.starts_with("log cut:") && notice.contains("10000 bytes") && notice.contains("169 lines"),
        "{notice}"
    );
    assert_eq!(log.iter().filter(|(s, _)| *s == Stream::System).count(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_secret_across_the_line_cut_is_masked() {
    for shift in 0..12 {
        let (out, mut rx) = emitter(&["S3CRET-value"], DEFAULT_MAX_LOG_BYTES);
        let (pipe, mut job) = tokio::io::duplex(256 * 1024);
        let reader = tokio::spawn(lines(out, Stream::Stdout, pipe));
        let mut text = "x".repeat(LINE_CUT - shift).into_bytes();
        text.extend_from_slice(b"S3CRET-value and \xc3\xa9\xe2\x82\xac more\n");
        job.write_all(&text).await.unwrap();
        drop(job);
        reader.await.unwrap();
        let log: String = queued(&mut rx).into_iter().map(|(_, t)| t).collect();
        assert!(!log.contains("S3CRET-value"), "secret leaked with the cut {shift} bytes before it");
        assert!(log.contains("*** and é€ more"), "{}", &log[log.len() - 40..]);
        assert!(!log.contains('\u{fffd}'), "a character was split by the cut");
    }
}

/// What a real shell job's standard output becomes in its log, with `secrets`.
async fn shell_log(secrets: &[&str], script: &str) -> Vec<(Stream, String)> {
    let (out, mut rx) = emitter(secrets, DEFAULT_MAX_LOG_BYTES);
    let mut child = tokio::process::Command::new("bash")
        .args(["-c", script])
        .env("SECRET", secrets.first().copied().unwrap_or_default())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    lines(out, Stream::Stdout, child.stdout.take().unwrap()).await;
    assert!(child.wait().await.unwrap().success());
    queued(&mut rx)
}

#[tokio::test(flavor = "current_thread")]
async fn a_job_printing_the_base64_or_hex_of_a_secret_shows_stars() {
    let log = shell_log(
        &["hf_Sup3rS3cretValue42"],
        r#"echo -n "$SECRET" | base64
           echo "$SECRET" | base64
           printf 'user:%s' "$SECRET" | base64
           printf 'ab%s' "$SECRET" | base64 | tr '+/' '-_' | tr -d '='
           echo -n "$SECRET" | xxd -p -c 64
           printf 'https://x/?t=%s' "$(echo -n "$SECRET" | xxd -p -c 64 | sed 's/../%&/g')""#,
    )
    .await;
    let text: Vec<&str> = log.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(text[..2], ["***", "***"], "{text:?}");
    assert!(text[2].starts_with("dXNlcj") && text[2].ends_with("***"), "{text:?}");
    assert!(text[3].starts_with("YW") && text[3].ends_with("***"), "{text:?}");
    assert_eq!(text[4..], ["***", "https://x/?t=***"], "{text:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_value_registered_with_add_mask_is_masked_from_then_on_and_short_ones_are_refused() {
    let log = shell_log(
        &["hf_Sup3rS3cretValue42"],
        r#"derived=$(echo -n "$SECRET" | rev)
           echo "before: $derived"
           echo "::add-mask::$derived"
           echo "after: $derived"
           echo -n "$derived" | base64
           echo "::add-mask::abc"
           echo "short abc"
           echo "$SECRET-$derived""#,
    )
    .await;
    let derived: String = "hf_Sup3rS3cretValue42".chars().rev().collect();
    assert_eq!(log[0].1, format!("before: {derived}"), "what came before stays as it was");
    let rest: Vec<(Stream, &str)> = log[1..].iter().map(|(s, t)| (*s, t.as_str())).collect();
    assert_eq!(
        rest,
        [
            (Stream::Stdout, "::add-mask::***"),
            (Stream::Stdout, "after: ***"),
            (Stream::Stdout, "***"),
            (Stream::System, "add-mask: a value of 3 characters is too short to be a secret (at least 4); not masked"),
            (Stream::Stdout, "short abc"),
            (Stream::Stdout, "***-***"),
        ]
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_add_mask_line_longer_than_the_cut_is_not_shown() {
    let (out, mut rx) = emitter(&[], DEFAULT_MAX_LOG_BYTES);
    let (pipe, mut job) = tokio::io::duplex(256 * 1024);
    let reader = tokio::spawn(lines(out, Stream::Stdout, pipe));
    let mut text = b"::add-mask::".to_vec();
    text.extend(std::iter::repeat_n(b'v', 3 * LINE_CUT));
    text.extend_from_slice(b"\nnext line\n");
    job.write_all(&text).await.unwrap();
    drop(job);
    reader.await.unwrap();
    let log = queued(&mut rx);
    assert_eq!(log.len(), 2, "{:?}", log.iter().map(|(s, t)| (s, &t[..t.len().min(40)])).collect::<Vec<_>>());
    assert!(log[0].0 == Stream::System && log[0].1.contains("longer than"), "{:?}", log[0]);
    assert_eq!(log[1], (Stream::Stdout, "next line".to_string()));
}

#[test]
fn whole_utf8_characters() {
    assert_eq!(complete_utf8(b"abc"), 3);
    assert_eq!(complete_utf8("é".as_bytes()), 2);
    assert_eq!(complete_utf8(&"€".as_bytes()[..2]), 0);
    assert_eq!(complete_utf8(&b"ab\xf0\x9f\x98"[..]), 2);
    assert_eq!(complete_utf8(b"ab\xff"), 3);
}
