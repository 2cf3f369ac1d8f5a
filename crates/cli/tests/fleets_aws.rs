//! Issue 11: an `aws` fleet end to end, against a real EC2 API server (moto_server on
//! 127.0.0.1, with a proxy answering EC2's capacity errors; `crates/aws/tests/common/moto.rs`).
//! The "machine" boots by running the user data EC2 holds for it, here: a real `gpuci agent`.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;
#[path = "../../aws/tests/common/moto.rs"]
mod moto;

use common::*;
use serde_json::Value;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

/// A job no agent can take makes an instance (the first offer's capacity error moves to the
/// next), the instance's user data starts an agent with the machine's own registration token,
/// the job runs there with its cost, and the idle instance is terminated.
#[test]
fn a_queued_job_makes_an_instance_whose_user_data_runs_it_and_the_idle_instance_is_stopped_then_terminated() {
    let Some(moto) = moto::start("fleets_aws") else { return };
    let proxy = moto::FaultProxy::start(&moto, vec![moto::Fault::capacity(&["InstanceType=g6.xlarge"])]);
    let dir = tempdir();
    let config = dir.path().join("server.toml");
    let agent_dir = dir.path().join("machine-agent");
    std::fs::write(
        &config,
        format!(
            r#"
[[fleet]]
name = "l4"
provider = "aws"
max = 1
idle_timeout = "2s"
stopped_timeout = "3s"
boot_timeout = "120s"
[fleet.machine]
gpu_model = "NVIDIA L4"
gpus = 1
gpu_memory = "22GiB"
cpus = 2
memory = "4GiB"
[[fleet.offer]]
instance_type = "g6.xlarge"
zone = "us-east-1a"
price_per_hour = 0.805
[[fleet.offer]]
instance_type = "g6.2xlarge"
zone = "us-east-1b"
price_per_hour = 0.978
[fleet.settings]
region = "{region}"
image = "ami-12c6146b"
endpoint_url = "{endpoint}"
agent_program = "{bin}"
agent_args = ["--simulate-gpus", "1xL4", "--slots", "1", "--isolation", "{iso}", "--data-dir", "{agent_dir}"]
"#,
            region = moto::REGION,
            endpoint = proxy.url,
            bin = BIN,
            iso = isolation(),
            agent_dir = agent_dir.display(),
        ),
    )
    .unwrap();
    let server = Server::start_with_env(
        &dir.path().join("server"),
        "127.0.0.1:0",
        ["--heartbeat", "200ms", "--lost-after", "20s", "--fleet-interval", "300ms", "--config"]
            .iter()
            .map(|s| s.to_string())
            .chain([config.display().to_string()])
            .collect(),
        &[("AWS_ACCESS_KEY_ID", "AKIDTEST"), ("AWS_SECRET_ACCESS_KEY", "secret")],
    );
    let api = server.api();
    let p =
        api.submit("steps:\n  - key: a\n    gpus: 1\n    gpu: {model: \"*L4\"}\n    command: echo on $GPUCI_GPUS\n");

    // The instance, in the second offer: the first answered InsufficientInstanceCapacity.
    let instances = || {
        moto::query(
            &moto,
            &[("Action", "DescribeInstances"), ("Filter.1.Name", "tag:gpuci.fleet"), ("Filter.1.Value.1", "l4")],
        )
    };
    wait_until_or("an instance of fleet l4", T, || instances().contains("<instanceId>"), instances);
    let described = instances();
    assert!(described.contains("<instanceType>g6.2xlarge</instanceType>"), "{described}");
    assert!(described.contains("<availabilityZone>us-east-1b</availabilityZone>"), "{described}");
    assert!(proxy.run_instances_calls() >= 2, "the first offer was not tried");
    let fleets: Vec<Value> = api.get("/api/v1/fleets");
    assert!(fleets[0]["recent_errors"].to_string().contains("InsufficientInstanceCapacity"), "{:#}", fleets[0]);
    let id = moto::xml_text(&described, "instanceId").unwrap().to_string();

    // Boot it: what EC2 would run at first boot.
    let attr =
        moto::query(&moto, &[("Action", "DescribeInstanceAttribute"), ("InstanceId", &id), ("Attribute", "userData")]);
    use base64::Engine as _;
    let script = String::from_utf8(
        base64::engine::general_purpose::STANDARD.decode(moto::xml_text(&attr, "value").unwrap()).unwrap(),
    )
    .unwrap();
    assert!(!script.contains(&server.registration_token()), "the machine got the coordinator's registration token");
    assert!(script.contains("GPUCI_REGISTRATION_TOKEN='gpuci_mreg."), "{script}");
    let user_data = dir.path().join("user-data.sh");
    std::fs::write(&user_data, &script).unwrap();
    let mut machine = std::process::Command::new("sh")
        .arg(&user_data)
        .env_clear()
        .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("machine.log")).unwrap())
        .spawn()
        .unwrap();

    let machine_log = dir.path().join("machine.log");
    wait_until_or(
        "the job to run on the instance's agent",
        T,
        || api.job(p.jobs[0].id).state.is_terminal(),
        || {
            let log = std::fs::read_to_string(&machine_log).unwrap_or_default();
            format!("{:#?}\n{:#?}\nmachine's agent:\n{log}", api.job(p.jobs[0].id), api.agents())
        },
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    // Its cost, once the reconcile loop has tied the agent to its machine.
    let job_id = done.jobs[0].id;
    wait_until_or("the job's cost", T, || api.job(job_id).cost.is_some(), || format!("{:#?}", api.job(job_id)));
    let cost = api.job(job_id).cost.unwrap();
    assert_eq!((cost.fleet.as_str(), cost.price_per_hour), ("l4", 0.978), "the second offer's price: {cost:?}");
    // Idle past idle_timeout: stopped at EC2 (an on-demand fleet's default), then, stopped
    // past stopped_timeout, terminated.
    let state = || {
        let d = moto::query(&moto, &[("Action", "DescribeInstances"), ("InstanceId.1", &id)]);
        d.split("<instanceState>").nth(1).and_then(|s| moto::xml_text(s, "name")).unwrap_or_default().to_string()
    };
    wait_until_or("the idle instance stopped", T, || matches!(state().as_str(), "stopping" | "stopped"), state);
    wait_until_or("the stopped instance terminated", T, || state() == "terminated", state);
    let _ = machine.kill();
    let _ = machine.wait();
}
