//! `GET /v1/models`, `GET /v1/models/{id}` and `GET /health`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;

use super::error::ApiError;
use super::openai_types::{ModelCard, ModelList};
use super::AppState;
use crate::proposer::Health;

fn card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.model_name.clone(),
        object: "model",
        created: state.started,
        owned_by: "specula",
        max_model_len: state.engine.model().context_len(),
    }
}

/// 404 `model_not_found` for a model other than the served one.
pub fn not_found(state: &AppState, model: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "the model `{model}` does not exist; this server serves `{}`",
            state.model_name
        ),
        param: Some("model".into()),
        code: "model_not_found",
    }
}

/// `GET /v1/models`: the one served model.
pub async fn list(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    state.metrics.request("models", 200);
    Json(ModelList {
        object: "list",
        data: vec![card(&state)],
    })
}

/// `GET /v1/models/{id}`: the served model, or 404.
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    if id != state.model_name {
        state.metrics.request("models", 404);
        return Err(not_found(&state, &id));
    }
    state.metrics.request("models", 200);
    Ok(Json(card(&state)))
}

/// `GET /health`: 200 with the queue depth, the drafter installed and its health
/// (`"degraded"` while it misses deadlines or restarts: the engine drafts less with it, or
/// not at all, until it answers in time again; `null` without a drafter); 503 with status
/// `"stopped"` once the engine has stopped (it could not start over after a failure), so a
/// load balancer takes the server out.
pub async fn health(State(state): State<Arc<AppState>>) -> (StatusCode, Json<serde_json::Value>) {
    let drafter_health = state.engine.drafter_health().map(|h| match h {
        Health::Healthy => "healthy",
        Health::Degraded => "degraded",
        Health::Failed => "failed",
    });
    let (status, word) = match state.engine.is_alive() {
        true => (StatusCode::OK, "ok"),
        false => (StatusCode::SERVICE_UNAVAILABLE, "stopped"),
    };
    (
        status,
        Json(serde_json::json!({
            "status": word,
            "model": state.model_name,
            "queue_depth": state.engine.queue_depth(),
            "drafter": state.admin.current_name(),
            "drafter_health": drafter_health,
        })),
    )
}
