//! Glance v2: the version list and two read-only images.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use super::state::SimState;

/// Id of the `vq-worker` image (the image a vq pool boots).
pub const WORKER_IMAGE_ID: &str = "5c0e9d7a-3b1f-4e8a-9c2d-7f6b1a0e4d21";
/// Id of the `cirros-fake` image (same id as in the shared OpenStack fixture).
pub const CIRROS_IMAGE_ID: &str = "6f2b9b4e-0c0a-4c55-9d51-0fa6e0c1e001";

/// A stored image.
pub(crate) struct Image {
    pub id: &'static str,
    pub name: &'static str,
    pub disk_format: &'static str,
    pub size: u64,
}

const IMAGES: [Image; 2] = [
    Image {
        id: WORKER_IMAGE_ID,
        name: "vq-worker",
        disk_format: "qcow2",
        size: 536_870_912,
    },
    Image {
        id: CIRROS_IMAGE_ID,
        name: "cirros-fake",
        disk_format: "raw",
        size: 1024,
    },
];

/// Look an image up by id.
pub(crate) fn find(id: &str) -> Option<&'static Image> {
    IMAGES.iter().find(|i| i.id == id)
}

pub(crate) fn router(state: Arc<SimState>) -> Router {
    let authed = Router::new()
        .route("/image/v2/images", get(list))
        .route("/image/v2/images/{id}", get(show))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            super::compute::require_token,
        ));
    Router::new()
        .route("/image", get(versions))
        .route("/image/", get(versions))
        .route("/image/versions", get(versions))
        .merge(authed)
        .with_state(state)
}

async fn versions(State(state): State<Arc<SimState>>) -> Response {
    let href = format!("{}/image/v2/", state.base());
    let versions: Vec<Value> = [("v2.17", "CURRENT"), ("v2.16", "SUPPORTED"), ("v2.0", "SUPPORTED")]
        .iter()
        .map(|(id, status)| json!({"id": id, "status": status, "links": [{"rel": "self", "href": href}]}))
        .collect();
    (
        StatusCode::MULTIPLE_CHOICES,
        axum::Json(json!({ "versions": versions })),
    )
        .into_response()
}

fn image_json(state: &SimState, i: &Image) -> Value {
    json!({
        "id": i.id,
        "name": i.name,
        "status": "active",
        "visibility": "public",
        "protected": false,
        "os_hidden": false,
        "container_format": "bare",
        "disk_format": i.disk_format,
        "min_disk": 0,
        "min_ram": 0,
        "size": i.size,
        "virtual_size": i.size,
        "checksum": format!("{:032x}", i.size),
        "os_hash_algo": "sha512",
        "os_hash_value": format!("{:0128x}", i.size),
        "owner": state.project_id,
        "tags": [],
        "created_at": "2026-01-01T00:00:00Z",
        "updated_at": "2026-01-01T00:00:00Z",
        "self": format!("/v2/images/{}", i.id),
        "file": format!("/v2/images/{}/file", i.id),
        "schema": "/v2/schemas/image",
    })
}

async fn list(
    State(state): State<Arc<SimState>>,
    Query(params): Query<Vec<(String, String)>>,
) -> Response {
    let get = |k: &str| {
        params
            .iter()
            .find(|(pk, _)| pk == k)
            .map(|(_, v)| v.as_str())
    };
    let images: Vec<Value> = IMAGES
        .iter()
        .filter(|i| get("name").is_none_or(|n| n == i.name))
        .filter(|i| get("id").is_none_or(|n| n == i.id))
        .filter(|_| get("status").is_none_or(|s| s == "active"))
        .filter(|_| get("visibility").is_none_or(|v| v == "public" || v == "all"))
        .map(|i| image_json(&state, i))
        .collect();
    let query: Vec<String> = params.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let first = if query.is_empty() {
        "/v2/images".to_string()
    } else {
        format!("/v2/images?{}", query.join("&"))
    };
    axum::Json(json!({"images": images, "first": first, "schema": "/v2/schemas/images"}))
        .into_response()
}

async fn show(State(state): State<Arc<SimState>>, Path(id): Path<String>) -> Response {
    match find(&id) {
        Some(i) => axum::Json(image_json(&state, i)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            format!("404 Not Found\n\nNo image found with ID {id}\n\n   "),
        )
            .into_response(),
    }
}
