//! `/api/v1/schedules`: the schedules with their next run and latest fires, and "run now"
//! (on the record as the caller). The schedules' task is [`crate::schedules`].

use crate::error::{ApiError, ApiPath};
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use gpuci_core::schedule::next_after;
use gpuci_protocol::api::{ErrorBody, ScheduleFire, ScheduleSummary};
use gpuci_store::ScheduleFireRecord;
use jiff::Timestamp;

/// The schedules, their next run and latest fires.
#[utoipa::path(get, path = "/api/v1/schedules",
    responses((status = 200, body = Vec<ScheduleSummary>),
        (status = 503, description = "the database cannot be read now", body = ErrorBody)))]
pub async fn list_schedules(State(st): State<AppState>) -> Result<Json<Vec<ScheduleSummary>>, ApiError> {
    Ok(Json(summaries(&st).await?))
}

/// Every configured schedule with its next run and latest fires (the API and the dashboard).
pub(crate) async fn summaries(st: &AppState) -> Result<Vec<ScheduleSummary>, ApiError> {
    let now = Timestamp::now();
    let mut out = Vec::new();
    for spec in st.schedules.specs.iter() {
        let next = spec.enabled.then(|| next_after(&spec.cron, &spec.tz, now)).flatten();
        let mut fires = Vec::new();
        for f in st.store.schedule_fires(Some(&spec.name), 10).await? {
            fires.push(fire_summary(st, f).await?);
        }
        out.push(ScheduleSummary {
            name: spec.name.clone(),
            cron: spec.cron.as_str().to_string(),
            timezone: spec.timezone.clone(),
            repository: spec.repository.clone(),
            branch: spec.branch.clone(),
            pipeline: spec.pipeline.clone(),
            enabled: spec.enabled,
            next_run_ms: next.map(|t| t.as_millisecond()),
            next_run_local: next.map(|t| t.to_zoned(spec.tz.clone()).strftime("%Y-%m-%dT%H:%M:%S%:z").to_string()),
            fires,
        });
    }
    Ok(out)
}

async fn fire_summary(st: &AppState, f: ScheduleFireRecord) -> Result<ScheduleFire, ApiError> {
    let pipeline_state = match f.pipeline_id {
        Some(p) => {
            let jobs: Vec<_> =
                st.store.pipeline_jobs(p).await?.iter().map(|j| crate::convert::job_summary(j, None)).collect();
            Some(crate::convert::pipeline_state(&jobs))
        }
        None => None,
    };
    Ok(ScheduleFire {
        id: f.id,
        cause: f.cause,
        scheduled_at_ms: f.scheduled_at_ms,
        fired_at_ms: f.fired_at_ms,
        skipped_from_ms: f.skipped_from_ms,
        pipeline_id: f.pipeline_id,
        pipeline_state,
        error: f.error,
    })
}

/// Fire a schedule now (also a disabled one), and answer once its pipeline is submitted or
/// its fire failed (then with the reason in `error`: the fire is recorded all the same).
#[utoipa::path(post, path = "/api/v1/schedules/{name}/run", params(("name" = String, Path, description = "schedule name")),
    responses((status = 201, description = "fired: its pipeline, or why there is none", body = ScheduleFire),
        (status = 404, description = "no such schedule", body = ErrorBody),
        (status = 503, description = "shutting down, or the database cannot take it now", body = ErrorBody)))]
pub async fn run_schedule(
    State(st): State<AppState>,
    axum::Extension(actor): axum::Extension<crate::api::audit::Actor>,
    ApiPath(name): ApiPath<String>,
) -> Result<(StatusCode, Json<ScheduleFire>), ApiError> {
    Ok((StatusCode::CREATED, Json(fire_now(&st, &actor, name).await?)))
}

/// Fires schedule `name` now, on the record as `actor` (the API and the dashboard).
pub(crate) async fn fire_now(
    st: &AppState,
    actor: &crate::api::audit::Actor,
    name: String,
) -> Result<ScheduleFire, ApiError> {
    if !st.schedules.specs.iter().any(|s| s.name == name) {
        let known: Vec<&str> = st.schedules.specs.iter().map(|s| s.name.as_str()).collect();
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no schedule {name:?} (configured: {})",
                if known.is_empty() { "none".into() } else { known.join(", ") }
            ),
        ));
    }
    let fire = match st.schedules.run_now(name.clone()).await {
        None => return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the coordinator is shutting down")),
        Some(fire) => fire.map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e))?,
    };
    // On the record, with what came of it: a pipeline, or why there is none.
    let outcome = match (fire.pipeline_id, &fire.error) {
        (Some(p), _) => Ok(p),
        (None, Some(e)) => Err(e.clone()),
        (None, None) => Err("not submitted yet".to_string()),
    };
    let object = match outcome {
        Ok(p) => format!("schedule {name} (pipeline {p})"),
        Err(_) => format!("schedule {name}"),
    };
    crate::api::audit::record(st, actor, gpuci_core::audit::AuditAction::ScheduleRun, object, &outcome).await?;
    fire_summary(st, fire).await
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(list_schedules, run_schedule), components(schemas(ScheduleSummary, ScheduleFire)))]
pub struct SchedulesDoc;
