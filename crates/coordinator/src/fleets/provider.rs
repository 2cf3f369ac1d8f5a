//! The fleets' side of provider calls: which provider a fleet gets ([`provider_for`]), a
//! wrapper that counts every call by fleet, provider, call and result, and how a provider's
//! answers are taken (a machine id it may hand back, a machine it lists that the store does not
//! know). What a provider does is `gpuci_providers`' business, not this module's.

use gpuci_core::fleet::FleetSpec;
use gpuci_providers::ProviderMachine;
use gpuci_store::MachineRecord;
use std::sync::Arc;

/// A provider whose every call is counted by fleet, provider, call and result.
pub(super) struct Counted {
    pub(super) inner: Box<dyn gpuci_providers::Provider>,
    pub(super) fleet: String,
    pub(super) provider: String,
    pub(super) metrics: Arc<crate::metrics::Metrics>,
}

impl Counted {
    fn note<T>(&self, call: &str, r: gpuci_providers::ProviderResult<T>) -> gpuci_providers::ProviderResult<T> {
        self.metrics.provider_call(&self.fleet, &self.provider, call, r.is_ok());
        r
    }
}

#[async_trait::async_trait]
impl gpuci_providers::Provider for Counted {
    fn can_stop(&self) -> bool {
        self.inner.can_stop()
    }
    async fn create(&self, req: &gpuci_providers::CreateRequest) -> gpuci_providers::ProviderResult<ProviderMachine> {
        let r = self.inner.create(req).await;
        self.note("create", r)
    }
    async fn list(&self) -> gpuci_providers::ProviderResult<Vec<ProviderMachine>> {
        let r = self.inner.list().await;
        self.note("list", r)
    }
    async fn delete(&self, machine: &str) -> gpuci_providers::ProviderResult<()> {
        let r = self.inner.delete(machine).await;
        self.note("delete", r)
    }
    async fn stop(&self, machine: &str) -> gpuci_providers::ProviderResult<ProviderMachine> {
        let r = self.inner.stop(machine).await;
        self.note("stop", r)
    }
    async fn start(&self, machine: &str) -> gpuci_providers::ProviderResult<ProviderMachine> {
        let r = self.inner.start(machine).await;
        self.note("start", r)
    }
}

/// Start the loop; `None` when there are no fleets. Providers that cannot be made are shown as
/// unavailable on their fleet (and logged), never silently skipped.
/// The provider of `fleet`: `aws` and `kubernetes` from their own crates (their SDKs are large
/// and stay out of the providers crate), the others from `gpuci_providers`. An error a person can act on when the
/// fleet's settings cannot work.
pub fn provider_for(
    fleet: &FleetSpec,
    coordinator: &str,
    registration_token: &str,
    data_dir: &std::path::Path,
) -> Result<Box<dyn gpuci_providers::Provider>, String> {
    match fleet.provider {
        gpuci_core::fleet::ProviderKind::Aws => {
            Ok(Box::new(gpuci_aws::AwsProvider::from_settings(fleet, coordinator)?))
        }
        gpuci_core::fleet::ProviderKind::Kubernetes => {
            Ok(Box::new(gpuci_kube::KubeProvider::from_settings(fleet, coordinator)?))
        }
        _ => gpuci_providers::for_fleet(fleet, coordinator, registration_token, data_dir),
    }
}

/// A machine id a provider may hand back: a short printable token (it goes into tags, file
/// names, commands and terminals).
pub(super) fn valid_machine_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// A machine the provider lists under this coordinator's tag that the store does not know
/// (created just before a crash): recorded from what the provider says.
pub(super) fn adopted(fleet: &FleetSpec, pm: &ProviderMachine, now_ms: i64) -> MachineRecord {
    let offer = fleet.offers.iter().find(|o| o.instance_type == pm.instance_type && o.zone == pm.zone);
    MachineRecord {
        id: pm.machine.clone(),
        fleet: fleet.name.clone(),
        provider_id: Some(pm.provider_id.clone()),
        instance_type: pm.instance_type.clone(),
        zone: pm.zone.clone(),
        capacity: pm.capacity.as_str().into(),
        price_per_hour: offer.map_or(0.0, |o| o.price(pm.capacity)),
        gpus: fleet.machine.gpus,
        state: "booting".into(),
        reason: Some("adopted: listed by the provider, unknown to this coordinator's store".into()),
        agent_id: None,
        requested_at_ms: pm.launched_at.map_or(now_ms, |t| t as i64 * 1000),
        running_at_ms: None,
        connected_at_ms: None,
        first_job_at_ms: None,
        ended_at_ms: None,
        boot_failed: false,
        interrupted_at_ms: None,
    }
}
