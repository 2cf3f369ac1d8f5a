//! The agent channel's JSON is a contract between versions of coordinator and agent: these
//! tests pin its shape. Changing one means bumping PROTOCOL_VERSION.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::job::Outcome;
use gpuci_protocol::agent::*;
use serde_json::json;
use std::collections::BTreeMap;

#[test]
fn coordinator_messages_have_a_stable_shape() {
    let m = CoordinatorMessage::Cancel { job_id: 7, reason: "cancelled by user".into() };
    assert_eq!(
        serde_json::to_value(&m).unwrap(),
        json!({"type": "cancel", "job_id": 7, "reason": "cancelled by user"})
    );
    let m = CoordinatorMessage::Acked { upto: 3 };
    assert_eq!(serde_json::to_value(&m).unwrap(), json!({"type": "acked", "upto": 3}));
    let m = CoordinatorMessage::GpuReleased { uuid: "GPU-1".into() };
    assert_eq!(serde_json::to_value(&m).unwrap(), json!({"type": "gpu_released", "uuid": "GPU-1"}));
}

#[test]
fn agent_messages_round_trip() {
    let f = JobFinished {
        job_id: 9,
        outcome: Outcome::Exited { code: 2 },
        finished_at_us: 1,
        started_at_us: Some(0),
        lines: None,
        telemetry: None,
        gpu_health: BTreeMap::from([("GPU-1".to_string(), GpuHealth::Unhealthy { reason: "xid".into() })]),
    };
    let v = serde_json::to_value(AgentMessage::Event { n: 4, event: JobEvent::Finished(f.clone()) }).unwrap();
    assert_eq!(v["type"], "event");
    assert_eq!(v["n"], 4);
    assert_eq!(v["event"]["kind"], "finished");
    assert_eq!(v["event"]["outcome"], json!({"kind": "exited", "code": 2}));
    assert_eq!(v["event"]["gpu_health"]["GPU-1"], json!({"status": "unhealthy", "reason": "xid"}));
    match serde_json::from_value::<AgentMessage>(v).unwrap() {
        AgentMessage::Event { n: 4, event: JobEvent::Finished(back) } => assert_eq!(back, f),
        other => panic!("{other:?}"),
    }
    // The optional fields may be left out.
    let short = json!({"type": "event", "n": 1, "event": {"kind": "finished", "job_id": 1,
        "outcome": {"kind": "exited", "code": 0}, "finished_at_us": 5}});
    assert!(matches!(
        serde_json::from_value::<AgentMessage>(short).unwrap(),
        AgentMessage::Event { event: JobEvent::Finished(JobFinished { started_at_us: None, .. }), .. }
    ));
    let log = AgentMessage::Event {
        n: 5,
        event: JobEvent::Log {
            job_id: 2,
            first_seq: 7,
            lines: vec![LogChunk { ts_us: 1, stream: Stream::Stdout, text: "x".into() }],
        },
    };
    assert_eq!(
        serde_json::to_value(&log).unwrap(),
        json!({"type": "event", "n": 5, "event": {"kind": "log", "job_id": 2, "first_seq": 7,
            "lines": [{"ts_us": 1, "stream": "stdout", "text": "x"}]}})
    );
}

#[test]
fn secret_values_never_show_in_debug_output() {
    let s = SecretValues(BTreeMap::from([("HF_TOKEN".to_string(), "hf_very_secret".to_string())]));
    let dbg = format!("{s:?}");
    assert!(dbg.contains("HF_TOKEN") && !dbg.contains("hf_very_secret"), "{dbg}");
}

#[test]
fn unknown_messages_are_errors_not_panics() {
    assert!(serde_json::from_str::<CoordinatorMessage>(r#"{"type": "reboot"}"#).is_err());
    assert!(serde_json::from_str::<AgentMessage>("not json").is_err());
}

/// Protocol 4: a step whose artifacts could not be stored (the coordinator unreachable past the
/// agent's retries) ends with this outcome, and fails.
#[test]
fn an_artifacts_lost_outcome_has_a_stable_shape() {
    let o = Outcome::ArtifactsLost { error: "artifact \"a.whl\" could not be stored: 503".into() };
    let v = serde_json::to_value(&o).unwrap();
    assert_eq!(v, json!({"kind": "artifacts_lost", "error": "artifact \"a.whl\" could not be stored: 503"}));
    assert_eq!(serde_json::from_value::<Outcome>(v).unwrap(), o);
}
