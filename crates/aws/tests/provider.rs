//! The aws provider against a real EC2 API server (moto_server on 127.0.0.1; see
//! `common/moto.rs`), with a proxy in front for EC2's capacity, quota and throttling answers.
//! No AWS account is involved: nothing here leaves the loopback interface.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "common/moto.rs"]
mod moto;

use gpuci_aws::{AwsCredentials, AwsProvider};
use gpuci_core::fleet::{parse_fleets, Capacity, FleetSpec};
use gpuci_providers::{AgentLaunch, CreateRequest, ErrorKind, Provider, ProviderState};
use std::collections::BTreeMap;

fn fleet(name: &str, endpoint: &str, extra: &str, settings: &str) -> FleetSpec {
    let text = format!(
        r#"
[[fleet]]
name = "{name}"
provider = "aws"
max = 4
{extra}
[fleet.machine]
gpus = 1
gpu_model = "NVIDIA A10G"
gpu_memory = "22GiB"
cpus = 4
memory = "16GiB"
[[fleet.offer]]
instance_type = "g5.xlarge"
zone = "us-east-1a"
price_per_hour = 1.006
spot_price_per_hour = 0.45
[[fleet.offer]]
instance_type = "g5.2xlarge"
zone = "us-east-1b"
price_per_hour = 1.212
[fleet.settings]
region = "{region}"
image = "ami-12c6146b"
endpoint_url = "{endpoint}"
{settings}
"#,
        region = moto::REGION
    );
    parse_fleets("server.toml", &text).unwrap_or_else(|e| panic!("{e}\n{text}")).remove(0)
}

fn provider(spec: &FleetSpec, coordinator: &str) -> AwsProvider {
    let creds = AwsCredentials::new("AKIDTEST", "secret", None, None, "test");
    AwsProvider::with_credentials(spec, coordinator, creds).expect("provider")
}

fn request(spec: &FleetSpec, machine: &str, offer: usize, capacity: Capacity) -> CreateRequest {
    let mut tags = BTreeMap::new();
    tags.insert(gpuci_providers::TAG_FLEET.to_string(), spec.name.clone());
    tags.insert(gpuci_providers::TAG_MACHINE.to_string(), machine.to_string());
    tags.insert("pool".to_string(), "a10g".to_string());
    CreateRequest {
        machine: machine.to_string(),
        offer: spec.offers[offer].clone(),
        capacity,
        agent: AgentLaunch {
            server: "https://gpuci.example.org".into(),
            registration_token: format!("gpuci_mreg.{machine}.00ff"),
            coordinator_key: Some("ed25519:00".into()),
            tags,
            name: format!("{}-{machine}", spec.name),
            program: "/usr/local/bin/gpuci".into(),
            extra_args: vec!["--leave-after-unreachable".into(), "10m".into()],
        },
    }
}

/// Everything a reconcile loop asks of a provider, against the EC2 API: create (tagged, in the
/// offer's type and zone, idempotent by machine id), list (only this coordinator's fleet),
/// stop, start, delete (a missing machine is deleted already), spot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_lists_stops_starts_and_deletes_instances_by_their_tags() {
    let Some(moto) = moto::start("aws_lifecycle") else { return };
    let spec = fleet("a10g", &moto.url, "", "");
    let p = provider(&spec, "coord-1");
    assert!(p.can_stop(), "an on-demand fleet stops and starts");
    assert!(p.list().await.expect("list").is_empty());

    let m = p.create(&request(&spec, "m-1", 0, Capacity::OnDemand)).await.expect("create");
    assert_eq!((m.machine.as_str(), m.instance_type.as_str(), m.zone.as_str()), ("m-1", "g5.xlarge", "us-east-1a"));
    assert!(m.provider_id.starts_with("i-"), "{m:?}");
    assert_eq!(m.capacity, Capacity::OnDemand);
    assert!(m.launched_at.is_some());
    // Asked again (a coordinator that crashed after asking): the same instance, not a second.
    let again = p.create(&request(&spec, "m-1", 0, Capacity::OnDemand)).await.expect("create again");
    assert_eq!(again.provider_id, m.provider_id);
    // Even for another offer: the machine exists already.
    let other_offer = p.create(&request(&spec, "m-1", 1, Capacity::OnDemand)).await.expect("create, other offer");
    assert_eq!(other_offer.provider_id, m.provider_id);

    // Its tags and user data: the agent's command with the machine's own token.
    let attr = moto::query(
        &moto,
        &[("Action", "DescribeInstanceAttribute"), ("InstanceId", &m.provider_id), ("Attribute", "userData")],
    );
    let data = moto::xml_text(&attr, "value").expect("user data");
    use base64::Engine as _;
    let script = String::from_utf8(base64::engine::general_purpose::STANDARD.decode(data).unwrap()).unwrap();
    assert!(script.contains("GPUCI_REGISTRATION_TOKEN='gpuci_mreg.m-1.00ff'"), "{script}");
    assert!(script.contains("GPUCI_COORDINATOR_KEY='ed25519:00'\nexport GPUCI_COORDINATOR_KEY\n"), "{script}");
    assert!(script.contains("exec '/usr/local/bin/gpuci' 'agent' '--server' 'https://gpuci.example.org'"), "{script}");
    assert!(script.contains("'--tag' 'gpuci.machine=m-1'"), "{script}");
    let described = moto::query(&moto, &[("Action", "DescribeInstances"), ("InstanceId.1", &m.provider_id)]);
    for tag in ["gpuci.coordinator", "coord-1", "gpuci.fleet", "a10g", "gpuci.machine", "gpuci.tag.pool"] {
        assert!(described.contains(&format!(">{tag}<")), "tag {tag} missing: {described}");
    }

    // Another fleet's and another coordinator's instances are not this fleet's.
    let other_fleet = fleet("other", &moto.url, "", "");
    provider(&other_fleet, "coord-1").create(&request(&other_fleet, "m-9", 0, Capacity::OnDemand)).await.unwrap();
    provider(&spec, "coord-2").create(&request(&spec, "m-8", 0, Capacity::OnDemand)).await.unwrap();
    let spot = p.create(&request(&spec, "m-2", 0, Capacity::Spot)).await.expect("spot");
    assert_eq!(spot.capacity, Capacity::Spot);
    let mut listed = p.list().await.expect("list");
    listed.sort_by(|a, b| a.machine.cmp(&b.machine));
    let names: Vec<&str> = listed.iter().map(|m| m.machine.as_str()).collect();
    assert_eq!(names, ["m-1", "m-2"], "{listed:#?}");
    assert_eq!(listed[1].capacity, Capacity::Spot, "the list says which are spot");

    let stopped = p.stop("m-1").await.expect("stop");
    assert!(matches!(stopped.state, ProviderState::Stopping | ProviderState::Stopped), "{stopped:?}");
    let started = p.start("m-1").await.expect("start");
    assert!(matches!(started.state, ProviderState::Pending | ProviderState::Running), "{started:?}");

    p.delete("m-1").await.expect("delete");
    p.delete("m-1").await.expect("a deleted machine is deleted already");
    p.delete("m-never").await.expect("a machine that never existed is deleted already");
    let names: Vec<String> = p.list().await.unwrap().into_iter().map(|m| m.machine).collect();
    assert_eq!(names, ["m-2"]);
    let err = p.stop("m-1").await.expect_err("a deleted machine does not stop");
    assert_eq!(err.kind, ErrorKind::NotFound);
}

/// EC2's capacity error (HTTP 500 `InsufficientInstanceCapacity`) is a capacity error, asked
/// once (no SDK retry: the reconcile loop moves to the next offer instead); quota, invalid and
/// throttling answers are sorted the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ec2_errors_move_to_the_next_offer_and_a_capacity_error_is_asked_once() {
    let Some(moto) = moto::start("aws_errors") else { return };
    let proxy = moto::FaultProxy::start(
        &moto,
        vec![
            moto::Fault::capacity(&["InstanceType=g5.xlarge", "MarketType=spot"]),
            moto::Fault::capacity(&["InstanceType=g5.xlarge", "AvailabilityZone=us-east-1a"]),
            moto::Fault { when: vec!["m-quota".into()], status: 400, code: "VcpuLimitExceeded".into() },
            moto::Fault { when: vec!["m-ami".into()], status: 400, code: "InvalidAMIID.NotFound".into() },
            moto::Fault { when: vec!["m-busy".into()], status: 503, code: "RequestLimitExceeded".into() },
        ],
    );
    let spec = fleet("a10g", &proxy.url, "", "");
    let p = provider(&spec, "coord-1");
    let err = p.create(&request(&spec, "m-1", 0, Capacity::Spot)).await.expect_err("no spot capacity");
    assert_eq!(err.kind, ErrorKind::Capacity, "{err}");
    assert!(err.is_capacity() && err.message.contains("InsufficientInstanceCapacity"), "{err}");
    assert_eq!(proxy.run_instances_calls(), 1, "a capacity error was sent again");
    // The next offer (another type and zone) is asked, and made.
    let m = p.create(&request(&spec, "m-1", 1, Capacity::OnDemand)).await.expect("the next offer");
    assert_eq!((m.instance_type.as_str(), m.zone.as_str()), ("g5.2xlarge", "us-east-1b"));
    let sorted = [("m-quota", ErrorKind::Quota), ("m-ami", ErrorKind::Invalid), ("m-busy", ErrorKind::Transient)];
    for (machine, kind) in sorted {
        let err = p.create(&request(&spec, machine, 1, Capacity::OnDemand)).await.expect_err(machine);
        assert_eq!(err.kind, kind, "{machine}: {err}");
    }
    // Nothing was made for the refused requests.
    let names: Vec<String> = p.list().await.unwrap().into_iter().map(|m| m.machine).collect();
    assert_eq!(names, ["m-1"]);
}

/// Settings that cannot work are refused, saying which and why.
#[test]
fn impossible_settings_are_refused_with_the_reason() {
    let creds = || AwsCredentials::new("AKIDTEST", "secret", None, None, "test");
    let refused = |extra: &str, settings: &str| {
        let mut spec = fleet("a10g", "http://127.0.0.1:9", extra, settings);
        if settings.contains("NO-IMAGE") {
            spec.settings.remove("image");
        }
        AwsProvider::with_credentials(&spec, "c", creds()).expect_err("refused")
    };
    assert!(refused("", "NO-IMAGE = 1").contains("unknown field"), "unknown keys are refused");
    let e = refused("capacity = \"spot\"\nidle_action = \"stop\"", "");
    assert!(e.contains("idle_action") && e.contains("on-demand"), "{e}");
    let e = refused("", "subnets = { \"eu-west-1a\" = \"subnet-1\" }");
    assert!(e.contains("eu-west-1a") && e.contains("no offer"), "{e}");
    let e = refused("", "instance_profile = 7");
    assert!(e.contains("instance_profile") || e.contains("invalid type"), "{e}");
    let mut spec = fleet("a10g", "http://127.0.0.1:9", "", "");
    spec.settings.remove("image");
    let e = AwsProvider::with_credentials(&spec, "c", creds()).expect_err("no image");
    assert!(e.contains("image") && e.contains("launch_template"), "{e}");
    spec.settings.insert("launch_template".into(), toml::Value::String("lt-0abc".into()));
    assert!(AwsProvider::with_credentials(&spec, "c", creds()).is_ok(), "a launch template names the image");
}

/// Jobs must never hold the machine's role: every instance is IMDSv2-only with a hop limit of
/// 1, and has no metadata endpoint unless something on the host needs it (a spot instance's
/// interruption watch, or an instance profile). Read back from the EC2 API's own description.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_get_imdsv2_only_a_hop_limit_of_one_and_no_endpoint_they_do_not_need() {
    let Some(moto) = moto::start("aws_metadata") else { return };
    let options = |id: &str| {
        let d = moto::query(&moto, &[("Action", "DescribeInstances"), ("InstanceId.1", id)]);
        let get = |tag: &str| moto::xml_text(&d, tag).map(str::to_string);
        (get("httpTokens"), get("httpPutResponseHopLimit"), get("httpEndpoint"))
    };
    let spec = fleet("md", &moto.url, "", "");
    let p = provider(&spec, "coord-md");
    let on_demand = p.create(&request(&spec, "m-od", 0, Capacity::OnDemand)).await.expect("on-demand");
    let spot = p.create(&request(&spec, "m-spot", 0, Capacity::Spot)).await.expect("spot");
    let want = |endpoint: &str| (Some("required".to_string()), Some("1".to_string()), Some(endpoint.to_string()));
    assert_eq!(options(&on_demand.provider_id), want("disabled"), "nothing on an on-demand machine needs IMDS");
    assert_eq!(options(&spot.provider_id), want("enabled"), "the agent watches for spot interruption notices");

    moto::query_service(
        &moto,
        "iam",
        "2010-05-08",
        &[("Action", "CreateInstanceProfile"), ("InstanceProfileName", "gpuci-runner")],
    );
    let with_role = fleet("role", &moto.url, "", r#"instance_profile = "gpuci-runner""#);
    let p = provider(&with_role, "coord-md");
    let m = p.create(&request(&with_role, "m-role", 0, Capacity::OnDemand)).await.expect("with a role");
    assert_eq!(options(&m.provider_id), want("enabled"), "an instance profile is for the host's own use");
    let off = fleet("off", &moto.url, "", r#"instance_metadata = "disabled""#);
    let p = provider(&off, "coord-md");
    let m = p.create(&request(&off, "m-off", 0, Capacity::Spot)).await.expect("disabled");
    assert_eq!(options(&m.provider_id), want("disabled"));
    let bad = fleet("bad", &moto.url, "", r#"instance_metadata = "maybe""#);
    let creds = AwsCredentials::new("AKIDTEST", "secret", None, None, "test");
    let e = AwsProvider::with_credentials(&bad, "c", creds).expect_err("an unknown instance_metadata");
    assert!(e.contains("maybe"), "{e}");
}
