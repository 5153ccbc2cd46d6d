//! `GET /v1/models` and `GET /health`.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;

use super::openai_types::{ModelCard, ModelList};
use super::AppState;

/// `GET /v1/models`: the one served model.
pub async fn list(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    state.metrics.request("models", 200);
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.model_name.clone(),
            object: "model",
            created: state.started,
            owned_by: "specula",
            max_model_len: state.engine.model().context_len(),
        }],
    })
}

/// `GET /health`: 200 with the queue depth and whether a drafter is installed.
pub async fn health(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "status": "ok",
        "model": state.model_name,
        "queue_depth": state.engine.queue_depth(),
        "drafter": state.admin.current_name(),
    }))
}
