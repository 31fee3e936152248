//! The read-only Neutron v2.0 subset the controller's online configuration
//! check uses: the project's networks and security groups (fixed: network
//! [`NETWORK_NAME`] / [`NETWORK_ID`], security group `default`), and Nova's
//! key pair list (fixed: [`KEYPAIR_NAME`]) in [`super::compute`]'s router.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;

use super::state::SimState;

/// The one network of the project.
pub const NETWORK_NAME: &str = "private";
/// Its id.
pub const NETWORK_ID: &str = "5e0d3a5c-7a6b-4a8e-9c8f-0a1b2c3d4e5f";
/// The one key pair of the user.
pub const KEYPAIR_NAME: &str = "vq-key";

pub(crate) fn router(state: Arc<SimState>) -> Router {
    Router::new()
        .route("/network/v2.0/networks", get(networks))
        .route("/network/v2.0/security-groups", get(security_groups))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            super::compute::require_token,
        ))
        .with_state(state)
}

async fn networks(State(state): State<Arc<SimState>>) -> Response {
    axum::Json(json!({"networks": [{
        "id": NETWORK_ID,
        "name": NETWORK_NAME,
        "status": "ACTIVE",
        "admin_state_up": true,
        "shared": false,
        "project_id": state.project_id,
        "tenant_id": state.project_id,
        "subnets": [],
    }]}))
    .into_response()
}

async fn security_groups(State(state): State<Arc<SimState>>) -> Response {
    axum::Json(json!({"security_groups": [{
        "id": "8b9c0d1e-2f3a-4b5c-8d7e-9f0a1b2c3d4e",
        "name": "default",
        "description": "Default security group",
        "project_id": state.project_id,
        "tenant_id": state.project_id,
        "security_group_rules": [],
    }]}))
    .into_response()
}

/// Nova's `GET /os-keypairs`.
pub(crate) async fn keypairs() -> Response {
    axum::Json(json!({"keypairs": [{"keypair": {
        "name": KEYPAIR_NAME,
        "type": "ssh",
        "fingerprint": "7e:eb:ab:24:ba:d1:e1:88:ae:9a:fb:66:53:df:d3:bd",
        "public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyForTheTestCloudOnly vq@cloudsim",
    }}]}))
    .into_response()
}
