//! The schedules page and its "Run now" button.

use super::*;

pub(super) async fn schedules_page(State(st): State<AppState>, headers: HeaderMap) -> Response {
    let v = viewer(&st, &headers);
    if !v.signed_in() {
        return sign_in_first("/ui/schedules");
    }
    match crate::api::schedules::summaries(&st).await {
        Ok(list) => html(gpuci_web::schedules(&list, &v, now_ms())),
        Err(e) => api_error(&v, e),
    }
}

/// "Run now": fires the schedule and goes to its pipeline, or back to the list where the
/// fire says why there is none.
pub(super) async fn run_now(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let v = match may_change(&st, &headers, &f.csrf) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let actor = crate::api::audit::Actor::dashboard(&st.api_token);
    match crate::api::schedules::fire_now(&st, &actor, name).await {
        Ok(fire) => match fire.pipeline_id {
            Some(p) => Redirect::to(&format!("/ui/pipelines/{p}")).into_response(),
            None => Redirect::to("/ui/schedules").into_response(),
        },
        Err(e) => api_error(&v, e),
    }
}
