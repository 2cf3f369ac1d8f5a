//! The `aws` provider: a fleet's machines are EC2 instances, made through the AWS SDK for Rust
//! (`aws-sdk-ec2`). It lives in a crate of its own because the SDK is large (a cold build of
//! this crate takes minutes on a small machine; BENCHMARKS.md): crates that do not need it
//! never wait for it.
//!
//! What it does, and only this: turns the [`Provider`] calls into `RunInstances`,
//! `DescribeInstances` (by gpuci's tags), `TerminateInstances`, `StopInstances` and
//! `StartInstances`, and sorts EC2's error codes into [`ErrorKind`]s, so that a capacity error
//! (`InsufficientInstanceCapacity`, a zone that lacks the type, spot capacity) moves the
//! reconcile loop to the fleet's next offer instead of failing a job. Every instance carries
//! the tags `gpuci.coordinator`, `gpuci.fleet` and `gpuci.machine`, and is found again by them
//! alone: nothing is remembered between calls.
//!
//! What it must not do: decide (how many, which offer, when: `gpuci_core::fleet::decide`),
//! retry a create on its own (the SDK's retries are off for `RunInstances`; EC2 answers a
//! capacity error with HTTP 500, which the SDK would otherwise send again and again), or show
//! the registration token anywhere but in the instance's user data.
//!
//! Idempotency: EC2 keeps a `RunInstances` client token for a while and answers a repeat with
//! the same instance, but only for the same parameters, so the token names the machine *and*
//! the offer and capacity type. Some EC2-compatible servers ignore tokens; `create` therefore
//! looks for an instance with the machine's tag first, too (which also covers a coordinator
//! that crashed between two offers).

/// Shared blob storage in an S3-compatible bucket (the coordinator's uploads and artifacts):
/// here because it is the same SDK family, so it adds no second HTTP or TLS stack.
pub mod s3;

use async_trait::async_trait;
pub use aws_sdk_ec2::config::Credentials as AwsCredentials;
use aws_sdk_ec2::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_ec2::error::ProvideErrorMetadata;
use aws_sdk_ec2::types::{
    Filter, HttpTokensState, IamInstanceProfileSpecification, Instance, InstanceLifecycleType,
    InstanceMarketOptionsRequest, InstanceMetadataEndpointState, InstanceMetadataOptionsRequest,
    InstanceMetadataTagsState, InstanceStateName, InstanceType, LaunchTemplateSpecification, MarketType, Placement,
    ResourceType, ShutdownBehavior, SpotInstanceType, SpotMarketOptions, Tag, TagSpecification,
};
use gpuci_core::fleet::{Capacity, CapacityPolicy, FleetSpec, IdleAction};
use gpuci_providers::{
    CreateRequest, ErrorKind, Provider, ProviderError, ProviderMachine, ProviderResult, ProviderState, TAG_COORDINATOR,
    TAG_FLEET, TAG_MACHINE,
};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// `[fleet.settings]` of an `aws` fleet (docs/providers/aws.md).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    region: String,
    /// AMI with `gpuci` and the GPU driver; or a launch template that names one.
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    launch_template: Option<String>,
    /// Another EC2 endpoint (a VPC endpoint; a test server on loopback).
    #[serde(default)]
    endpoint_url: Option<String>,
    /// Zone → subnet to launch in.
    #[serde(default)]
    subnets: BTreeMap<String, String>,
    #[serde(default)]
    security_groups: Vec<String>,
    #[serde(default)]
    instance_profile: Option<String>,
    #[serde(default)]
    key_name: Option<String>,
    /// The instance metadata service: `"auto"` (on only where the machine needs it: spot
    /// interruption notices, or an `instance_profile` for the host's own use), `"enabled"` or
    /// `"disabled"`. Always IMDSv2 only with a hop limit of 1; jobs never reach it (their
    /// slot networks refuse link-local addresses, docs/sandbox.md).
    #[serde(default)]
    instance_metadata: InstanceMetadata,
    /// Names of the coordinator's environment variables holding the credentials (defaults:
    /// the AWS CLI's). An instance role is not read here: see docs/providers/aws.md.
    #[serde(default = "default_key_env")]
    access_key_id_env: String,
    #[serde(default = "default_secret_env")]
    secret_access_key_env: String,
    #[serde(default = "default_token_env")]
    session_token_env: String,
    /// How the machine's agent starts: read by the coordinator for every provider
    /// (docs/fleets.md); accepted here so a typo elsewhere is still refused.
    #[serde(default, rename = "server")]
    _server: Option<String>,
    #[serde(default, rename = "agent_program")]
    _agent_program: Option<String>,
    #[serde(default, rename = "agent_args")]
    _agent_args: Option<Vec<String>>,
    #[serde(default, rename = "leave_after_unreachable")]
    _leave_after_unreachable: Option<String>,
    #[serde(default, rename = "on_leave")]
    _on_leave: Option<String>,
}

/// `instance_metadata` of the settings.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum InstanceMetadata {
    #[default]
    Auto,
    Enabled,
    Disabled,
}

/// Whether an instance bought as `capacity` gets a metadata endpoint at all. `auto` turns it
/// on only where something on the host needs it: the agent's spot interruption watch (a spot
/// instance), or the operator's own use of an instance profile (an image pull from ECR by the
/// container engine, say). Every other machine has none, so nothing on it, job or not, can
/// read the instance's identity or credentials from it.
fn metadata_endpoint(setting: InstanceMetadata, capacity: Capacity, instance_profile: bool) -> bool {
    match setting {
        InstanceMetadata::Enabled => true,
        InstanceMetadata::Disabled => false,
        InstanceMetadata::Auto => capacity == Capacity::Spot || instance_profile,
    }
}

fn default_key_env() -> String {
    "AWS_ACCESS_KEY_ID".into()
}
fn default_secret_env() -> String {
    "AWS_SECRET_ACCESS_KEY".into()
}
fn default_token_env() -> String {
    "AWS_SESSION_TOKEN".into()
}

/// One fleet's EC2 instances.
pub struct AwsProvider {
    client: aws_sdk_ec2::Client,
    settings: Settings,
    coordinator: String,
    fleet: String,
    can_stop: bool,
}

impl std::fmt::Debug for AwsProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsProvider").field("fleet", &self.fleet).field("region", &self.settings.region).finish()
    }
}

impl AwsProvider {
    /// The provider of `fleet` for coordinator `coordinator`; an error a person can act on when
    /// the settings cannot work (checked at the server's start, before any machine is asked for).
    pub fn from_settings(fleet: &FleetSpec, coordinator: &str) -> Result<Self, String> {
        let settings = Self::settings(fleet)?;
        let key = std::env::var(&settings.access_key_id_env).ok().filter(|v| !v.is_empty());
        let secret = std::env::var(&settings.secret_access_key_env).ok().filter(|v| !v.is_empty());
        let (Some(key), Some(secret)) = (key, secret) else {
            return Err(format!(
                "fleet {}: no AWS credentials: set {} and {} in the coordinator's environment",
                fleet.name, settings.access_key_id_env, settings.secret_access_key_env
            ));
        };
        let token = std::env::var(&settings.session_token_env).ok().filter(|v| !v.is_empty());
        Self::with_credentials(fleet, coordinator, Credentials::new(key, secret, token, None, "gpuci-environment"))
    }

    /// As [`AwsProvider::from_settings`], with the credentials given instead of read from the
    /// environment.
    pub fn with_credentials(fleet: &FleetSpec, coordinator: &str, credentials: Credentials) -> Result<Self, String> {
        let settings = Self::settings(fleet)?;
        let can_stop = fleet.capacity == CapacityPolicy::OnDemand;
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut config = aws_sdk_ec2::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(settings.region.clone()))
            .credentials_provider(credentials)
            .http_client(http)
            .retry_config(aws_sdk_ec2::config::retry::RetryConfig::standard().with_max_attempts(3))
            .timeout_config(
                aws_sdk_ec2::config::timeout::TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .operation_attempt_timeout(Duration::from_secs(30))
                    .operation_timeout(Duration::from_secs(60))
                    .build(),
            );
        if let Some(url) = &settings.endpoint_url {
            config = config.endpoint_url(url);
        }
        Ok(AwsProvider {
            client: aws_sdk_ec2::Client::from_conf(config.build()),
            settings,
            coordinator: coordinator.to_string(),
            fleet: fleet.name.clone(),
            can_stop,
        })
    }

    /// The fleet's settings, checked: what cannot work is refused with the reason.
    fn settings(fleet: &FleetSpec) -> Result<Settings, String> {
        let bad = |what: String| format!("fleet {}: [fleet.settings]: {what}", fleet.name);
        let value = serde_json::to_value(&fleet.settings).map_err(|e| bad(e.to_string()))?;
        let settings: Settings = serde_json::from_value(value).map_err(|e| {
            bad(format!("{e} (an aws fleet needs region and image or launch_template, see docs/providers/aws.md)"))
        })?;
        if settings.region.trim().is_empty() {
            return Err(bad("region: give the AWS region, e.g. region = \"us-east-1\"".into()));
        }
        if settings.image.is_none() && settings.launch_template.is_none() {
            return Err(bad("give image = \"ami-…\" (an AMI with gpuci and the GPU driver) or launch_template".into()));
        }
        if let Some(url) = &settings.endpoint_url {
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                return Err(bad(format!("endpoint_url: {url:?} is not an http(s) URL")));
            }
        }
        for zone in settings.subnets.keys() {
            if !fleet.offers.iter().any(|o| &o.zone == zone) {
                return Err(bad(format!("subnets: zone {zone:?} is in no offer of the fleet")));
            }
        }
        // A one-time spot instance cannot be stopped; a persistent one comes back by itself
        // after a delete unless its request is cancelled. Stopping is for on-demand fleets.
        if fleet.idle_action == IdleAction::Stop && fleet.capacity != CapacityPolicy::OnDemand {
            return Err(bad(
                "idle_action = \"stop\" works with capacity = \"on-demand\" only (a spot instance is not stopped and started again)"
                    .into(),
            ));
        }
        Ok(settings)
    }

    fn tag_filter(key: &str, value: &str) -> Filter {
        Filter::builder().name(format!("tag:{key}")).values(value).build()
    }

    /// Instances of this coordinator and fleet (and `machine`, if given) that are not gone.
    async fn describe(&self, machine: Option<&str>) -> ProviderResult<Vec<Instance>> {
        let mut states = Filter::builder().name("instance-state-name");
        for s in ["pending", "running", "stopping", "stopped", "shutting-down"] {
            states = states.values(s);
        }
        let mut req = self
            .client
            .describe_instances()
            .filters(Self::tag_filter(TAG_COORDINATOR, &self.coordinator))
            .filters(Self::tag_filter(TAG_FLEET, &self.fleet))
            .filters(states.build());
        if let Some(m) = machine {
            req = req.filters(Self::tag_filter(TAG_MACHINE, m));
        }
        let mut pages = req.max_results(500).into_paginator().send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| classify("DescribeInstances", &e))?;
            for r in page.reservations() {
                out.extend(r.instances().iter().cloned());
            }
        }
        Ok(out)
    }

    /// The live instance of `machine` (the newest, should there be several).
    async fn find(&self, machine: &str) -> ProviderResult<Option<Instance>> {
        let mut found = self.describe(Some(machine)).await?;
        found.retain(|i| !matches!(state_of(i), ProviderState::Terminated));
        found.sort_by_key(|i| i.launch_time().map_or(0, |t| t.secs()));
        Ok(found.pop())
    }

    fn machine_of(&self, i: &Instance) -> Option<ProviderMachine> {
        let machine = i.tags().iter().find(|t| t.key() == Some(TAG_MACHINE))?.value()?.to_string();
        Some(ProviderMachine {
            machine,
            provider_id: i.instance_id()?.to_string(),
            state: state_of(i),
            instance_type: i.instance_type().map(|t| t.as_str().to_string()).unwrap_or_default(),
            zone: i.placement().and_then(|p| p.availability_zone()).unwrap_or_default().to_string(),
            capacity: match i.instance_lifecycle() {
                Some(InstanceLifecycleType::Spot) => Capacity::Spot,
                _ => Capacity::OnDemand,
            },
            launched_at: i.launch_time().and_then(|t| u64::try_from(t.secs()).ok()),
            note: i.state_reason().and_then(|r| r.message()).filter(|m| !m.is_empty()).map(String::from),
        })
    }

    async fn instance_id(&self, machine: &str) -> ProviderResult<Option<String>> {
        Ok(self.find(machine).await?.and_then(|i| i.instance_id().map(str::to_string)))
    }
}

/// EC2's state names as gpuci's.
fn state_of(i: &Instance) -> ProviderState {
    match i.state().and_then(|s| s.name()) {
        Some(InstanceStateName::Pending) => ProviderState::Pending,
        Some(InstanceStateName::Running) => ProviderState::Running,
        Some(InstanceStateName::Stopping | InstanceStateName::ShuttingDown) => ProviderState::Stopping,
        Some(InstanceStateName::Stopped) => ProviderState::Stopped,
        Some(InstanceStateName::Terminated) => ProviderState::Terminated,
        // An unknown state is not "gone": keep treating it as booting.
        _ => ProviderState::Pending,
    }
}

/// A `RunInstances` client token: at most 64 ASCII characters, one per machine *and* offer and
/// capacity type (EC2 refuses a repeated token with other parameters).
pub fn client_token(machine: &str, instance_type: &str, zone: &str, capacity: Capacity) -> String {
    // FNV-1a: stable across builds and platforms (std's hasher is not promised to be).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!("{machine}\0{instance_type}\0{zone}\0{}", capacity.as_str()).bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let head: String = machine.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(47).collect();
    format!("{head}-{h:016x}")
}

/// What an EC2 error means for the reconcile loop.
pub fn kind_of_code(code: &str) -> ErrorKind {
    let code = code.trim_start_matches("Server.").trim_start_matches("Client.");
    match code {
        "InsufficientInstanceCapacity"
        | "InsufficientHostCapacity"
        | "InsufficientReservedInstanceCapacity"
        | "InsufficientCapacity"
        | "UnfulfillableCapacity"
        | "SpotMaxPriceTooLow"
        | "InsufficientFreeAddressesInSubnet"
        | "InsufficientAddressCapacity"
        | "Unsupported" => ErrorKind::Capacity,
        "InstanceLimitExceeded" | "VcpuLimitExceeded" | "MaxSpotInstanceCountExceeded" => ErrorKind::Quota,
        "InvalidInstanceID.NotFound" => ErrorKind::NotFound,
        "RequestLimitExceeded"
        | "InternalError"
        | "InternalFailure"
        | "Unavailable"
        | "ServiceUnavailable"
        | "IncorrectInstanceState" => ErrorKind::Transient,
        c if c.starts_with("Invalid")
            || c.starts_with("Missing")
            || matches!(
                c,
                "UnauthorizedOperation"
                    | "AuthFailure"
                    | "OptInRequired"
                    | "Blocked"
                    | "IdempotentParameterMismatch"
                    | "UnsupportedOperation"
            ) =>
        {
            ErrorKind::Invalid
        }
        _ => ErrorKind::Transient,
    }
}

/// An SDK error as a [`ProviderError`]: EC2's code and message when it answered, else a
/// transient failure (no answer, a timeout).
fn classify<E, R>(op: &str, e: &aws_sdk_ec2::error::SdkError<E, R>) -> ProviderError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match e.code() {
        Some(code) => ProviderError::new(
            kind_of_code(code),
            format!("EC2 {op}: {code}: {}", e.message().unwrap_or("no message").trim()),
        ),
        None => ProviderError::new(
            ErrorKind::Transient,
            format!("EC2 {op}: {}", aws_sdk_ec2::error::DisplayErrorContext(e)),
        ),
    }
}

#[async_trait]
impl Provider for AwsProvider {
    fn can_stop(&self) -> bool {
        self.can_stop
    }

    async fn create(&self, req: &CreateRequest) -> ProviderResult<ProviderMachine> {
        if let Some(existing) = self.find(&req.machine).await? {
            if let Some(m) = self.machine_of(&existing) {
                return Ok(m);
            }
        }
        let s = &self.settings;
        let tag = |k: &str, v: &str| Tag::builder().key(k).value(v).build();
        let mut tags = TagSpecification::builder()
            .resource_type(ResourceType::Instance)
            .tags(tag(TAG_COORDINATOR, &self.coordinator))
            .tags(tag(TAG_FLEET, &self.fleet))
            .tags(tag(TAG_MACHINE, &req.machine))
            .tags(tag("Name", &format!("gpuci {} {}", self.fleet, req.machine)));
        let mut volume_tags = TagSpecification::builder().resource_type(ResourceType::Volume);
        for (k, v) in [(TAG_COORDINATOR, &self.coordinator), (TAG_FLEET, &self.fleet), (TAG_MACHINE, &req.machine)] {
            volume_tags = volume_tags.tags(tag(k, v));
        }
        use base64::Engine as _;
        let user_data = base64::engine::general_purpose::STANDARD.encode(req.agent.user_data());
        for (k, v) in &req.agent.tags {
            if k != TAG_FLEET && k != TAG_MACHINE {
                tags = tags.tags(tag(&format!("gpuci.tag.{k}"), v));
            }
        }
        let offer = &req.offer;
        let mut run = self
            .client
            .run_instances()
            .min_count(1)
            .max_count(1)
            .instance_type(InstanceType::from(offer.instance_type.as_str()))
            .client_token(client_token(&req.machine, &offer.instance_type, &offer.zone, req.capacity))
            .user_data(user_data)
            .tag_specifications(tags.build())
            .tag_specifications(volume_tags.build())
            // A machine that shuts itself down (the agent's `on_leave`) is gone, not stopped.
            .instance_initiated_shutdown_behavior(ShutdownBehavior::Terminate);
        if let Some(image) = &s.image {
            run = run.image_id(image);
        }
        if let Some(lt) = &s.launch_template {
            let spec = LaunchTemplateSpecification::builder().version("$Latest");
            run = run.launch_template(if lt.starts_with("lt-") {
                spec.launch_template_id(lt).build()
            } else {
                spec.launch_template_name(lt).build()
            });
        }
        match s.subnets.get(&offer.zone) {
            Some(subnet) => run = run.subnet_id(subnet),
            None if !offer.zone.is_empty() => {
                run = run.placement(Placement::builder().availability_zone(&offer.zone).build());
            }
            None => {}
        }
        for g in &s.security_groups {
            run = run.security_group_ids(g);
        }
        if let Some(p) = &s.instance_profile {
            let spec = IamInstanceProfileSpecification::builder();
            run = run.iam_instance_profile(if p.starts_with("arn:") { spec.arn(p) } else { spec.name(p) }.build());
        }
        if let Some(k) = &s.key_name {
            run = run.key_name(k);
        }
        // IMDSv2 only (a token from a PUT, which a forwarded GET cannot get), a hop limit of 1
        // (a container with its own network on the host cannot use the token), and no endpoint
        // where nothing on the machine needs one.
        let endpoint = metadata_endpoint(s.instance_metadata, req.capacity, s.instance_profile.is_some());
        run = run.metadata_options(
            InstanceMetadataOptionsRequest::builder()
                .http_tokens(HttpTokensState::Required)
                .http_put_response_hop_limit(1)
                .http_endpoint(if endpoint {
                    InstanceMetadataEndpointState::Enabled
                } else {
                    InstanceMetadataEndpointState::Disabled
                })
                .instance_metadata_tags(InstanceMetadataTagsState::Disabled)
                .build(),
        );
        if req.capacity == Capacity::Spot {
            run = run.instance_market_options(
                InstanceMarketOptionsRequest::builder()
                    .market_type(MarketType::Spot)
                    .spot_options(SpotMarketOptions::builder().spot_instance_type(SpotInstanceType::OneTime).build())
                    .build(),
            );
        }
        // No SDK retries: a capacity error is HTTP 500, and the reconcile loop moves to the next
        // offer instead; anything transient is asked again on its next pass (same token).
        let out = run
            .customize()
            .config_override(
                aws_sdk_ec2::Config::builder().retry_config(aws_sdk_ec2::config::retry::RetryConfig::disabled()),
            )
            .send()
            .await
            .map_err(|e| classify("RunInstances", &e))?;
        let instance = out
            .instances()
            .first()
            .ok_or_else(|| ProviderError::new(ErrorKind::Transient, "EC2 RunInstances answered without an instance"))?;
        let mut m = self.machine_of(instance).unwrap_or_else(|| ProviderMachine {
            machine: req.machine.clone(),
            provider_id: instance.instance_id().unwrap_or_default().to_string(),
            state: state_of(instance),
            instance_type: offer.instance_type.clone(),
            zone: offer.zone.clone(),
            capacity: req.capacity,
            launched_at: None,
            note: None,
        });
        if m.machine != req.machine {
            return Err(ProviderError::new(
                ErrorKind::Invalid,
                format!("EC2 RunInstances answered with instance {} of machine {}", m.provider_id, m.machine),
            ));
        }
        // Some EC2-compatible servers do not report the lifecycle on the answer.
        if req.capacity == Capacity::Spot {
            m.capacity = Capacity::Spot;
        }
        Ok(m)
    }

    async fn list(&self) -> ProviderResult<Vec<ProviderMachine>> {
        let instances = self.describe(None).await?;
        Ok(instances.iter().filter_map(|i| self.machine_of(i)).collect())
    }

    async fn delete(&self, machine: &str) -> ProviderResult<()> {
        let Some(id) = self.instance_id(machine).await? else { return Ok(()) };
        match self.client.terminate_instances().instance_ids(&id).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let err = classify("TerminateInstances", &e);
                if err.kind == ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(err)
                }
            }
        }
    }

    async fn stop(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let not_found = || ProviderError::new(ErrorKind::NotFound, format!("machine {machine} has no instance"));
        let id = self.instance_id(machine).await?.ok_or_else(not_found)?;
        self.client.stop_instances().instance_ids(&id).send().await.map_err(|e| classify("StopInstances", &e))?;
        let i = self.find(machine).await?.ok_or_else(not_found)?;
        self.machine_of(&i).ok_or_else(not_found)
    }

    async fn start(&self, machine: &str) -> ProviderResult<ProviderMachine> {
        let not_found = || ProviderError::new(ErrorKind::NotFound, format!("machine {machine} has no instance"));
        let id = self.instance_id(machine).await?.ok_or_else(not_found)?;
        self.client.start_instances().instance_ids(&id).send().await.map_err(|e| classify("StartInstances", &e))?;
        let i = self.find(machine).await?.ok_or_else(not_found)?;
        self.machine_of(&i).ok_or_else(not_found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metadata_endpoint_is_off_unless_the_machine_needs_it() {
        use InstanceMetadata::*;
        assert!(!metadata_endpoint(Auto, Capacity::OnDemand, false), "nothing on an on-demand machine needs it");
        assert!(metadata_endpoint(Auto, Capacity::Spot, false), "the agent watches for spot interruption notices");
        assert!(metadata_endpoint(Auto, Capacity::OnDemand, true), "the operator gave the host a role");
        assert!(!metadata_endpoint(Disabled, Capacity::Spot, true));
        assert!(metadata_endpoint(Enabled, Capacity::OnDemand, false));
    }

    #[test]
    fn capacity_errors_move_to_the_next_offer_and_the_rest_are_sorted() {
        for c in [
            "InsufficientInstanceCapacity",
            "Server.InsufficientInstanceCapacity",
            "Unsupported",
            "UnfulfillableCapacity",
        ] {
            assert_eq!(kind_of_code(c), ErrorKind::Capacity, "{c}");
        }
        for c in ["VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded"] {
            assert_eq!(kind_of_code(c), ErrorKind::Quota, "{c}");
        }
        for c in [
            "InvalidAMIID.NotFound",
            "InvalidParameterValue",
            "AuthFailure",
            "UnauthorizedOperation",
            "MissingParameter",
        ] {
            assert_eq!(kind_of_code(c), ErrorKind::Invalid, "{c}");
        }
        assert_eq!(kind_of_code("InvalidInstanceID.NotFound"), ErrorKind::NotFound);
        for c in ["RequestLimitExceeded", "InternalError", "SomethingNew"] {
            assert_eq!(kind_of_code(c), ErrorKind::Transient, "{c}");
        }
    }

    #[test]
    fn a_client_token_is_per_machine_offer_and_capacity_and_fits_ec2() {
        let a = client_token("m-1", "g5.xlarge", "us-east-1a", Capacity::Spot);
        assert_eq!(a, client_token("m-1", "g5.xlarge", "us-east-1a", Capacity::Spot), "stable");
        assert_ne!(a, client_token("m-1", "g5.xlarge", "us-east-1a", Capacity::OnDemand));
        assert_ne!(a, client_token("m-1", "g5.2xlarge", "us-east-1a", Capacity::Spot));
        assert_ne!(a, client_token("m-1", "g5.xlarge", "us-east-1b", Capacity::Spot));
        assert_ne!(a, client_token("m-2", "g5.xlarge", "us-east-1a", Capacity::Spot));
        let long = client_token(&"x".repeat(200), "p4d.24xlarge", "us-west-2a", Capacity::OnDemand);
        assert!(long.len() <= 64 && long.is_ascii(), "{long}");
    }
}
