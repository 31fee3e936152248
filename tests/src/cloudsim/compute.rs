//! Nova v2.1: versions, microversions, flavors, servers, metadata, limits.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use base64::Engine;
use serde_json::{json, Map, Value};

use super::image;
use super::state::{flavor, Flavor, Phase, Server, SimState, FLAVORS};
use super::timefmt::{iso8601, Style};

/// Highest compute microversion the test cloud can serve, `2.96` (the
/// default of [`super::SimConfig::compute_max_minor`]).
pub const MAX_COMPUTE_MINOR: u32 = 96;
/// Nova's `osapi_max_limit`: the page size cap.
const MAX_LIMIT: usize = 1000;
/// Nova's `maxLength` of the base64 `user_data` string.
const MAX_USER_DATA_LEN: usize = 65535;
/// Nova's default `metadata_items` quota.
const MAX_METADATA_ITEMS: usize = 128;
/// Nova's `MAX_TAG_COUNT`.
const MAX_TAGS: usize = 50;

/// A Nova error response: `{"<fault name>": {"code", "message"}}`.
#[derive(Debug, Clone)]
pub(crate) struct NovaFault {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
}

impl NovaFault {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn with_retry_after(mut self, secs: Option<u64>) -> Self {
        self.retry_after = secs;
        self
    }

    fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn not_found(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("Instance {id} could not be found."),
        )
    }

    /// Nova's JSON-schema validation message.
    fn invalid(field: &str, value: &Value, why: impl std::fmt::Display) -> Self {
        Self::bad(format!(
            "Invalid input for field/attribute {field}. Value: {value}. {why}"
        ))
    }

    /// The name Nova's `Fault` wrapper gives each status.
    fn fault_name(status: StatusCode) -> &'static str {
        match status.as_u16() {
            400 => "badRequest",
            401 => "unauthorized",
            403 => "forbidden",
            404 => "itemNotFound",
            405 => "badMethod",
            409 => "conflictingRequest",
            413 | 429 => "overLimit",
            415 => "badMediaType",
            501 => "notImplemented",
            503 => "serviceUnavailable",
            _ => "computeFault",
        }
    }
}

impl IntoResponse for NovaFault {
    fn into_response(self) -> Response {
        let mut inner = json!({"code": self.status.as_u16(), "message": self.message});
        let over_limit = matches!(self.status.as_u16(), 413 | 429);
        if let (true, Some(secs)) = (over_limit, self.retry_after) {
            inner["retryAfter"] = json!(secs.to_string());
        }
        let body = json!({ Self::fault_name(self.status): inner });
        let mut resp = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert("Retry-After", HeaderValue::from(secs));
        }
        resp
    }
}

/// The negotiated compute microversion (`2.<minor>`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mv(u32);

impl Mv {
    fn at_least(self, minor: u32) -> bool {
        self.0 >= minor
    }
}

/// Parse `OpenStack-API-Version: compute X` or `X-OpenStack-Nova-API-Version: X`
/// against the served range `2.1 ..= 2.<max_minor>`.
fn negotiate(headers: &HeaderMap, max_minor: u32) -> Result<Mv, NovaFault> {
    let from_new = headers
        .get_all("OpenStack-API-Version")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|item| {
            let mut parts = item.split_whitespace();
            match (parts.next(), parts.next()) {
                (Some(service), Some(version)) if service.eq_ignore_ascii_case("compute") => {
                    Some(version.to_string())
                }
                _ => None,
            }
        });
    let requested = from_new.or_else(|| {
        headers
            .get("X-OpenStack-Nova-API-Version")
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_string())
    });
    let Some(requested) = requested else {
        return Ok(Mv(1));
    };
    if requested.eq_ignore_ascii_case("latest") {
        return Ok(Mv(max_minor));
    }
    let parsed = requested
        .split_once('.')
        .and_then(|(major, minor)| Some((major.parse::<u32>().ok()?, minor.parse::<u32>().ok()?)));
    match parsed {
        None => Err(NovaFault::bad(format!(
            "API Version String {requested} is of invalid format. Must be of format MajorNum.MinorNum."
        ))),
        Some((2, minor)) if (1..=max_minor).contains(&minor) => Ok(Mv(minor)),
        Some(_) => Err(NovaFault::new(
            StatusCode::NOT_ACCEPTABLE,
            format!(
                "Version {requested} is not supported by the API. Minimum is 2.1 and maximum is 2.{max_minor}."
            ),
        )),
    }
}

fn version_headers(resp: &mut Response, mv: Mv) {
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&format!("compute 2.{}", mv.0)) {
        h.insert("OpenStack-API-Version", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("2.{}", mv.0)) {
        h.insert("X-OpenStack-Nova-API-Version", v);
    }
    h.append("Vary", HeaderValue::from_static("OpenStack-API-Version"));
    h.append(
        "Vary",
        HeaderValue::from_static("X-OpenStack-Nova-API-Version"),
    );
    let request_id = format!("req-{}", uuid::Uuid::new_v4());
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        h.insert("x-openstack-request-id", v.clone());
        h.insert("x-compute-request-id", v);
    }
}

async fn microversion(
    State(state): State<Arc<SimState>>,
    mut req: Request,
    next: Next,
) -> Response {
    match negotiate(req.headers(), state.config.compute_max_minor) {
        Ok(mv) => {
            req.extensions_mut().insert(mv);
            let mut resp = next.run(req).await;
            version_headers(&mut resp, mv);
            resp
        }
        Err(fault) => fault.into_response(),
    }
}

/// keystonemiddleware's answer to a missing, unknown or expired token.
pub(crate) async fn require_token(
    State(state): State<Arc<SimState>>,
    req: Request,
    next: Next,
) -> Response {
    match super::identity::valid_token(&state, req.headers(), "X-Auth-Token") {
        Some(token) if token.scoped => next.run(req).await,
        _ => super::identity::keystone_error(
            &state,
            StatusCode::UNAUTHORIZED,
            "The request you have made requires authentication.",
        ),
    }
}

pub(crate) fn router(state: Arc<SimState>) -> Router {
    const P: &str = "/compute/v2.1";
    let authed = Router::new()
        .route(&format!("{P}/flavors"), get(list_flavors))
        .route(&format!("{P}/flavors/detail"), get(list_flavors_detail))
        .route(&format!("{P}/flavors/{{id}}"), get(show_flavor))
        .route(
            &format!("{P}/servers"),
            get(list_servers).post(create_server),
        )
        .route(&format!("{P}/servers/detail"), get(list_servers_detail))
        .route(
            &format!("{P}/servers/{{id}}"),
            get(show_server).delete(delete_server),
        )
        .route(
            &format!("{P}/servers/{{id}}/metadata"),
            get(get_metadata).put(replace_metadata).post(merge_metadata),
        )
        .route(
            &format!("{P}/servers/{{id}}/metadata/{{key}}"),
            get(get_metadata_item)
                .put(put_metadata_item)
                .delete(delete_metadata_item),
        )
        .route(&format!("{P}/servers/{{id}}/tags"), get(get_tags))
        .route(&format!("{P}/limits"), get(limits))
        .route(&format!("{P}/os-keypairs"), get(super::network::keypairs))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ));
    Router::new()
        .route("/compute", get(versions))
        .route("/compute/", get(versions))
        .route(P, get(version))
        .route(&format!("{P}/"), get(version))
        .merge(authed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            microversion,
        ))
        .with_state(state)
}

fn version_doc(state: &SimState) -> Value {
    json!({
        "id": "v2.1",
        "status": "CURRENT",
        "version": format!("2.{}", state.config.compute_max_minor),
        "min_version": "2.1",
        "updated": "2013-07-23T11:33:21Z",
        "links": [
            {"rel": "self", "href": format!("{}/compute/v2.1/", state.base())},
            {"rel": "describedby", "type": "text/html", "href": "http://docs.openstack.org/"}
        ],
        "media-types": [{
            "base": "application/json",
            "type": "application/vnd.openstack.compute+json;version=2.1"
        }]
    })
}

async fn versions(State(state): State<Arc<SimState>>) -> Response {
    axum::Json(json!({"versions": [version_doc(&state)]})).into_response()
}

async fn version(State(state): State<Arc<SimState>>) -> Response {
    axum::Json(json!({"version": version_doc(&state)})).into_response()
}

fn links(state: &SimState, collection: &str, id: &str) -> Value {
    let base = state.base();
    json!([
        {"rel": "self", "href": format!("{base}/compute/v2.1/{collection}/{id}")},
        {"rel": "bookmark", "href": format!("{base}/compute/{collection}/{id}")}
    ])
}

fn flavor_json(state: &SimState, f: &Flavor, mv: Mv, detail: bool) -> Value {
    let mut v = json!({"id": f.id, "name": f.name, "links": links(state, "flavors", f.id)});
    if mv.at_least(55) {
        v["description"] = Value::Null;
    }
    if detail {
        v["ram"] = json!(f.ram_mb);
        v["vcpus"] = json!(f.vcpus);
        v["disk"] = json!(f.disk_gb);
        v["swap"] = if mv.at_least(75) { json!(0) } else { json!("") };
        v["OS-FLV-EXT-DATA:ephemeral"] = json!(0);
        v["OS-FLV-DISABLED:disabled"] = json!(false);
        v["os-flavor-access:is_public"] = json!(true);
        v["rxtx_factor"] = json!(1.0);
        if mv.at_least(61) {
            v["extra_specs"] = json!({});
        }
    }
    v
}

async fn list_flavors(
    State(state): State<Arc<SimState>>,
    Extension(mv): Extension<Mv>,
) -> Response {
    let flavors: Vec<Value> = FLAVORS
        .iter()
        .map(|f| flavor_json(&state, f, mv, false))
        .collect();
    axum::Json(json!({ "flavors": flavors })).into_response()
}

async fn list_flavors_detail(
    State(state): State<Arc<SimState>>,
    Extension(mv): Extension<Mv>,
) -> Response {
    let flavors: Vec<Value> = FLAVORS
        .iter()
        .map(|f| flavor_json(&state, f, mv, true))
        .collect();
    axum::Json(json!({ "flavors": flavors })).into_response()
}

async fn show_flavor(
    State(state): State<Arc<SimState>>,
    Extension(mv): Extension<Mv>,
    Path(id): Path<String>,
) -> Result<Response, NovaFault> {
    let f = flavor(&id).ok_or_else(|| {
        NovaFault::new(
            StatusCode::NOT_FOUND,
            format!("Flavor {id} could not be found."),
        )
    })?;
    Ok(axum::Json(json!({"flavor": flavor_json(&state, &f, mv, true)})).into_response())
}

fn host_id(state: &SimState, s: &Server) -> String {
    if matches!(s.phase, Phase::Build) {
        return String::new();
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&state.project_id, "cloudsim").hash(&mut h);
    let x = h.finish();
    format!("{x:016x}{x:016x}{x:016x}{:08x}", x >> 32)
}

fn server_detail(state: &SimState, s: &Server, mv: Mv, show: bool) -> Value {
    let base = state.base();
    let flavor = if mv.at_least(47) {
        json!({
            "vcpus": s.flavor.vcpus, "ram": s.flavor.ram_mb, "disk": s.flavor.disk_gb,
            "ephemeral": 0, "swap": 0, "original_name": s.flavor.name, "extra_specs": {}
        })
    } else {
        json!({"id": s.flavor.id, "links": [{"rel": "bookmark", "href": format!("{base}/compute/flavors/{}", s.flavor.id)}]})
    };
    let mut v = json!({
        "id": s.id,
        "name": s.name,
        "status": s.status(),
        "tenant_id": state.project_id,
        "user_id": state.user_id,
        "metadata": s.metadata,
        "hostId": host_id(state, s),
        "image": {"id": s.image_id, "links": [{"rel": "bookmark", "href": format!("{base}/compute/images/{}", s.image_id)}]},
        "flavor": flavor,
        "created": iso8601(s.created, Style::Seconds),
        "updated": iso8601(s.updated, Style::Seconds),
        "addresses": {},
        "accessIPv4": "",
        "accessIPv6": "",
        "links": links(state, "servers", &s.id),
        "OS-DCF:diskConfig": "MANUAL",
        "OS-EXT-AZ:availability_zone": s.availability_zone,
        "config_drive": "",
        "key_name": s.key_name,
        "OS-SRV-USG:launched_at": s.launched.map(|t| iso8601(t, Style::MicrosNaive)),
        "OS-SRV-USG:terminated_at": null,
        "OS-EXT-STS:task_state": s.task_state(),
        "OS-EXT-STS:vm_state": s.vm_state(),
        "OS-EXT-STS:power_state": s.power_state(),
        "os-extended-volumes:volumes_attached": [],
    });
    // Nova lists the security groups of the server's ports; no NIC, no key.
    if s.has_ports {
        v["security_groups"] = json!([{"name": "default"}]);
    }
    if !matches!(s.phase, Phase::Error { .. }) {
        v["progress"] = json!(0);
    }
    if let Phase::Error { message, at } = &s.phase {
        v["fault"] =
            json!({"code": 500, "created": iso8601(*at, Style::Seconds), "message": message});
    }
    if mv.at_least(9) {
        v["locked"] = json!(false);
    }
    if mv.at_least(19) {
        v["description"] = json!(s.description);
    }
    if mv.at_least(26) {
        v["tags"] = json!(s.tags);
    }
    if mv.at_least(63) {
        v["trusted_image_certificates"] = Value::Null;
    }
    if mv.at_least(71) && show {
        v["server_groups"] = json!([]);
    }
    if mv.at_least(73) {
        v["locked_reason"] = Value::Null;
    }
    if mv.at_least(96) {
        v["pinned_availability_zone"] = Value::Null;
    }
    v
}

fn server_summary(state: &SimState, s: &Server) -> Value {
    json!({"id": s.id, "name": s.name, "links": links(state, "servers", &s.id)})
}

/// `application/x-www-form-urlencoded` the way Python's `urlencode` writes it.
fn urlencode(pairs: &[(String, String)]) -> String {
    let enc = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                b' ' => "+".into(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Filtered, paginated servers in Nova's default order
/// (`created_at desc, id desc`), plus the `servers_links` next link.
fn select_servers(
    state: &SimState,
    params: &[(String, String)],
    collection: &str,
) -> Result<(Vec<Server>, Vec<Value>), NovaFault> {
    let get = |k: &str| params.iter().rev().find(|(pk, _)| pk == k).map(|(_, v)| v);
    let (max_limit, overlapping, repeated) = {
        let inner = state.lock();
        (
            inner
                .faults
                .max_limit
                .map_or(MAX_LIMIT, |m| (m as usize).max(1)),
            inner.faults.overlapping_pages.unwrap_or(false),
            inner.faults.repeated_next_link.unwrap_or(false),
        )
    };
    let limit = match get("limit") {
        None => max_limit,
        Some(raw) => {
            let n: u64 = raw.parse().map_err(|_| {
                NovaFault::bad(format!(
                    "Invalid input for query parameters limit. Value: {raw}. '{raw}' does not match '^[0-9]*$'"
                ))
            })?;
            usize::try_from(n).unwrap_or(max_limit).min(max_limit)
        }
    };
    // An invalid pattern matches nothing (Nova's database would error).
    let name_re = get("name").map(|pattern| regex::Regex::new(pattern).ok());
    let statuses: Vec<String> = params
        .iter()
        .filter(|(k, _)| k == "status")
        .map(|(_, v)| v.to_ascii_uppercase())
        .collect();
    let tag_list = |k: &str| -> Option<BTreeSet<String>> {
        get(k).map(|v| {
            v.split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_string)
                .collect()
        })
    };
    let (tags_all, tags_any) = (tag_list("tags"), tag_list("tags-any"));
    let (not_all, not_any) = (tag_list("not-tags"), tag_list("not-tags-any"));

    let inner = state.lock();
    let hiding = inner.faults.hide_new_servers.unwrap_or(false);
    let mut all: Vec<&Server> = inner
        .servers
        .values()
        .filter(|s| !(hiding && s.hidden))
        .collect();
    all.sort_by(|a, b| b.created.cmp(&a.created).then(b.seq.cmp(&a.seq)));
    let start = match get("marker") {
        None => 0,
        Some(marker) => {
            all.iter()
                .position(|s| &s.id == marker)
                .ok_or_else(|| NovaFault::bad(format!("marker [{marker}] not found")))?
                + 1
        }
    };
    let matches = |s: &Server| -> bool {
        let name_ok = match &name_re {
            None => true,
            Some(None) => false,
            Some(Some(re)) => re.is_match(&s.name),
        };
        name_ok
            && (statuses.is_empty() || statuses.iter().any(|st| st == s.status()))
            && tags_all.as_ref().is_none_or(|t| t.is_subset(&s.tags))
            && tags_any
                .as_ref()
                .is_none_or(|t| t.iter().any(|x| s.tags.contains(x)))
            && not_all.as_ref().is_none_or(|t| !t.is_subset(&s.tags))
            && not_any
                .as_ref()
                .is_none_or(|t| !t.iter().any(|x| s.tags.contains(x)))
    };
    let page: Vec<Server> = all[start..]
        .iter()
        .filter(|s| matches(s))
        .take(limit)
        .map(|s| (*s).clone())
        .collect();
    drop(inner);
    let mut next = Vec::new();
    if limit > 0 && page.len() == limit {
        // With overlapping pages the next one starts at this page's last
        // server again (a page of one cannot overlap and make progress).
        let marker = if overlapping && page.len() > 1 {
            page.get(page.len() - 2)
        } else {
            page.last()
        };
        if let Some(last) = marker {
            let mut query: Vec<(String, String)> = params
                .iter()
                .filter(|(k, _)| repeated || k != "marker")
                .cloned()
                .collect();
            if !repeated {
                query.push(("marker".into(), last.id.clone()));
            }
            next.push(json!({
                "rel": "next",
                "href": format!("{}/compute/v2.1/{collection}?{}", state.base(), urlencode(&query)),
            }));
        }
    }
    Ok((page, next))
}

fn list_response(key_values: Vec<Value>, next: Vec<Value>) -> Response {
    let mut body = json!({ "servers": key_values });
    if !next.is_empty() {
        body["servers_links"] = json!(next);
    }
    axum::Json(body).into_response()
}

async fn list_servers(
    State(state): State<Arc<SimState>>,
    Query(params): Query<Vec<(String, String)>>,
) -> Result<Response, NovaFault> {
    let (page, next) = select_servers(&state, &params, "servers")?;
    let items = page.iter().map(|s| server_summary(&state, s)).collect();
    Ok(list_response(items, next))
}

async fn list_servers_detail(
    State(state): State<Arc<SimState>>,
    Extension(mv): Extension<Mv>,
    Query(params): Query<Vec<(String, String)>>,
) -> Result<Response, NovaFault> {
    let (page, next) = select_servers(&state, &params, "servers/detail")?;
    let items = page
        .iter()
        .map(|s| server_detail(&state, s, mv, false))
        .collect();
    Ok(list_response(items, next))
}

async fn show_server(
    State(state): State<Arc<SimState>>,
    Extension(mv): Extension<Mv>,
    Path(id): Path<String>,
) -> Result<Response, NovaFault> {
    let inner = state.lock();
    let s = inner
        .servers
        .get(&id)
        .ok_or_else(|| NovaFault::not_found(&id))?;
    Ok(axum::Json(json!({"server": server_detail(&state, s, mv, true)})).into_response())
}

/// Keys a create request may carry at a microversion (Nova's schema has
/// `additionalProperties: false`).
fn allowed_server_keys(mv: Mv) -> Vec<&'static str> {
    let mut keys = vec![
        "name",
        "imageRef",
        "flavorRef",
        "adminPass",
        "metadata",
        "networks",
        "OS-DCF:diskConfig",
        "accessIPv4",
        "accessIPv6",
        "user_data",
        "availability_zone",
        "block_device_mapping",
        "block_device_mapping_v2",
        "key_name",
        "security_groups",
        "config_drive",
        "min_count",
        "max_count",
        "return_reservation_id",
    ];
    if !mv.at_least(57) {
        keys.push("personality");
    }
    if mv.at_least(19) {
        keys.push("description");
    }
    if mv.at_least(52) {
        keys.push("tags");
    }
    if mv.at_least(63) {
        keys.push("trusted_image_certificates");
    }
    if mv.at_least(74) {
        keys.extend(["host", "hypervisor_hostname"]);
    }
    if mv.at_least(90) {
        keys.push("hostname");
    }
    keys
}

/// The trailing id of a reference that may be a bare id or a URL.
fn ref_id(v: &Value) -> Option<String> {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    let id = s
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("")
        .to_string();
    (!id.is_empty()).then_some(id)
}

fn is_uuid(s: &str) -> bool {
    uuid::Uuid::parse_str(s).is_ok()
}

fn metadata_key_ok(k: &str) -> bool {
    (1..=255).contains(&k.chars().count())
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_:. ".contains(c))
}

fn too_many_metadata() -> NovaFault {
    NovaFault::new(
        StatusCode::FORBIDDEN,
        format!("Maximum number of metadata items exceeds {MAX_METADATA_ITEMS}"),
    )
}

fn validate_metadata(field: &str, v: &Value) -> Result<BTreeMap<String, String>, NovaFault> {
    let obj = v
        .as_object()
        .ok_or_else(|| NovaFault::invalid(field, v, format!("{v} is not of type 'object'")))?;
    let mut out = BTreeMap::new();
    for (k, val) in obj {
        if !metadata_key_ok(k) {
            return Err(NovaFault::invalid(
                field,
                v,
                format!("Additional properties are not allowed ('{k}' was unexpected)"),
            ));
        }
        let s = val
            .as_str()
            .ok_or_else(|| NovaFault::invalid(k, val, format!("{val} is not of type 'string'")))?;
        if s.chars().count() > 255 {
            return Err(NovaFault::invalid(k, val, format!("{val} is too long")));
        }
        out.insert(k.clone(), s.to_string());
    }
    if out.len() > MAX_METADATA_ITEMS {
        return Err(too_many_metadata());
    }
    Ok(out)
}

fn validate_tags(v: &Value) -> Result<BTreeSet<String>, NovaFault> {
    let arr = v
        .as_array()
        .ok_or_else(|| NovaFault::invalid("tags", v, format!("{v} is not of type 'array'")))?;
    if arr.len() > MAX_TAGS {
        return Err(NovaFault::invalid("tags", v, format!("{v} is too long")));
    }
    arr.iter()
        .map(|t| {
            let s = t.as_str().ok_or_else(|| {
                NovaFault::invalid("tags", t, format!("{t} is not of type 'string'"))
            })?;
            if s.is_empty() || s.chars().count() > 60 || s.contains('/') || s.contains(',') {
                return Err(NovaFault::invalid(
                    "tags",
                    t,
                    format!("'{s}' does not match '^[^,/]*$'"),
                ));
            }
            Ok(s.to_string())
        })
        .collect()
}

fn validate_networks(v: &Value) -> Result<(), NovaFault> {
    match v {
        Value::String(s) if s == "none" || s == "auto" => Ok(()),
        Value::Array(items) => {
            for item in items {
                let uuid = item.get("uuid").and_then(Value::as_str);
                let port = item.get("port").and_then(Value::as_str);
                match (uuid, port) {
                    (Some(id), _) | (None, Some(id)) if is_uuid(id) => {}
                    _ => {
                        return Err(NovaFault::bad(format!(
                            "Bad networks format: network uuid is not in proper format ({item})"
                        )))
                    }
                }
            }
            Ok(())
        }
        other => Err(NovaFault::invalid(
            "networks",
            other,
            format!("{other} is not valid under any of the given schemas"),
        )),
    }
}

fn count_param(server: &Map<String, Value>, key: &str) -> Result<u32, NovaFault> {
    match server.get(key) {
        None => Ok(1),
        Some(v) => {
            let n = v
                .as_u64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
                .filter(|n| *n >= 1)
                .ok_or_else(|| {
                    NovaFault::invalid(key, v, format!("{v} is less than the minimum of 1"))
                })?;
            Ok(u32::try_from(n).unwrap_or(u32::MAX))
        }
    }
}

/// Decode base64 the way Nova's (Python's non-strict) decoder does: bytes
/// outside the alphabet are skipped, padding must still be right.
pub(crate) fn decode_user_data(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    let kept: String = s
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '='))
        .collect();
    base64::engine::general_purpose::STANDARD.decode(kept)
}

fn random_password() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789";
    let mut rng = rand::rng();
    (0..12)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

/// A validated create request.
struct CreateRequest {
    name: String,
    flavor: Flavor,
    image_id: String,
    metadata: BTreeMap<String, String>,
    tags: BTreeSet<String>,
    description: Option<String>,
    availability_zone: String,
    user_data: Option<String>,
    admin_pass: String,
    has_ports: bool,
    min_count: u32,
    max_count: u32,
}

fn validate_create(body: &Value, mv: Mv) -> Result<CreateRequest, NovaFault> {
    let server = body
        .get("server")
        .and_then(Value::as_object)
        .ok_or_else(|| NovaFault::invalid("server", body, "'server' is a required property"))?;
    let whole = Value::Object(server.clone());
    let allowed = allowed_server_keys(mv);
    if let Some(extra) = server.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(NovaFault::invalid(
            "server",
            &whole,
            format!("Additional properties are not allowed ('{extra}' was unexpected)"),
        ));
    }
    for required in ["name", "flavorRef"] {
        if !server.contains_key(required) {
            return Err(NovaFault::invalid(
                "server",
                &whole,
                format!("'{required}' is a required property"),
            ));
        }
    }
    if mv.at_least(37) && !server.contains_key("networks") {
        return Err(NovaFault::invalid(
            "server",
            &whole,
            "'networks' is a required property",
        ));
    }
    let name_v = &server["name"];
    let name = name_v
        .as_str()
        .filter(|n| !n.is_empty() && n.chars().count() <= 255 && n.trim() == *n)
        .ok_or_else(|| NovaFault::invalid("name", name_v, format!("{name_v} is not a valid name")))?
        .to_string();
    let flavor_id = ref_id(&server["flavorRef"])
        .ok_or_else(|| NovaFault::bad("Invalid flavorRef provided."))?;
    let flavor = flavor(&flavor_id)
        .ok_or_else(|| NovaFault::bad(format!("Flavor {flavor_id} could not be found.")))?;
    let image_id = match server.get("imageRef") {
        Some(v) => ref_id(v).ok_or_else(|| NovaFault::bad("Invalid imageRef provided."))?,
        None => return Err(NovaFault::bad("Block Device Mapping is Invalid: You specified more local devices than the limit allows")),
    };
    if !is_uuid(&image_id) {
        return Err(NovaFault::bad("Invalid imageRef provided."));
    }
    if image::find(&image_id).is_none() {
        return Err(NovaFault::bad("Can not find requested image"));
    }
    let metadata = match server.get("metadata") {
        Some(v) => validate_metadata("metadata", v)?,
        None => BTreeMap::new(),
    };
    let tags = match server.get("tags") {
        Some(v) => validate_tags(v)?,
        None => BTreeSet::new(),
    };
    let has_ports = match server.get("networks") {
        Some(v) => {
            validate_networks(v)?;
            v.as_str() != Some("none")
        }
        None => false,
    };
    let user_data = match server.get("user_data") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let s = v.as_str().ok_or_else(|| {
                NovaFault::invalid("user_data", v, format!("{v} is not of type 'string'"))
            })?;
            if s.len() > MAX_USER_DATA_LEN {
                return Err(NovaFault::invalid(
                    "user_data",
                    v,
                    format!("'{s}' is too long"),
                ));
            }
            if decode_user_data(s).is_err() {
                return Err(NovaFault::invalid(
                    "user_data",
                    v,
                    format!("'{s}' is not a 'base64'"),
                ));
            }
            Some(s.to_string())
        }
    };
    // The sim has no key pairs, so every key name is unknown.
    if server.get("key_name").is_some_and(|v| !v.is_null()) {
        return Err(NovaFault::bad("Invalid key_name provided."));
    }
    let description = match server.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) if d.chars().count() <= 255 => Some(d.clone()),
        Some(v) => {
            return Err(NovaFault::invalid(
                "description",
                v,
                format!("{v} is not a valid description"),
            ))
        }
    };
    let availability_zone = match server.get("availability_zone") {
        None | Some(Value::Null) => "nova".to_string(),
        Some(Value::String(az)) if az == "nova" => az.clone(),
        Some(v) => {
            return Err(NovaFault::bad(format!(
                "The requested availability zone is not available ({v})"
            )))
        }
    };
    let admin_pass = server
        .get("adminPass")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(random_password);
    let min_count = count_param(server, "min_count")?;
    let max_count = count_param(server, "max_count")?;
    if min_count > max_count {
        return Err(NovaFault::bad("min_count must be <= max_count"));
    }
    Ok(CreateRequest {
        name,
        flavor,
        image_id,
        metadata,
        tags,
        description,
        availability_zone,
        user_data,
        admin_pass,
        has_ports,
        min_count,
        max_count,
    })
}

async fn create_server(
    State(state): State<Arc<SimState>>,
    Extension(mv): Extension<Mv>,
    body: Bytes,
) -> Result<Response, NovaFault> {
    let body: Value =
        serde_json::from_slice(&body).map_err(|_| NovaFault::bad("Malformed request body"))?;
    let req = validate_create(&body, mv)?;
    let cfg = &state.config;
    let now = SystemTime::now();
    let mut created = Vec::new();
    {
        let mut inner = state.lock();
        let (used_n, used_c, used_r) = inner.usage();
        let by_instances = cfg.quota_instances.saturating_sub(used_n);
        let by_cores = cfg.quota_cores.saturating_sub(used_c) / req.flavor.vcpus.max(1);
        let by_ram = cfg.quota_ram_mb.saturating_sub(used_r) / req.flavor.ram_mb.max(1);
        let allowed = by_instances.min(by_cores).min(by_ram);
        if allowed < req.min_count {
            let (resource, requested, used, quota) = if by_instances < req.min_count {
                ("instances", req.min_count, used_n, cfg.quota_instances)
            } else if by_cores < req.min_count {
                (
                    "cores",
                    req.min_count * req.flavor.vcpus,
                    used_c,
                    cfg.quota_cores,
                )
            } else {
                (
                    "ram",
                    req.min_count * req.flavor.ram_mb,
                    used_r,
                    cfg.quota_ram_mb,
                )
            };
            tracing::info!(resource, requested, used, quota, "create refused: quota");
            return Err(NovaFault::new(
                StatusCode::FORBIDDEN,
                format!("Quota exceeded for {resource}: Requested {requested}, but already used {used} of {quota} {resource}"),
            ));
        }
        let count = req.max_count.min(allowed);
        let doomed_rate = inner.faults.create_error_rate.unwrap_or(0.0);
        let stuck = inner.faults.stuck_build.unwrap_or(false);
        let hidden = inner.faults.hide_new_servers.unwrap_or(false);
        for i in 0..count {
            let id = uuid::Uuid::new_v4().to_string();
            let name = if count > 1 {
                format!("{}-{}", req.name, i + 1)
            } else {
                req.name.clone()
            };
            let doomed = doomed_rate > 0.0 && rand::random::<f64>() < doomed_rate;
            inner.next_seq += 1;
            inner.created_total += 1;
            let server = Server {
                id: id.clone(),
                seq: inner.next_seq,
                name,
                flavor: req.flavor,
                image_id: req.image_id.clone(),
                key_name: None,
                metadata: req.metadata.clone(),
                tags: req.tags.clone(),
                description: req.description.clone(),
                availability_zone: req.availability_zone.clone(),
                user_data: req.user_data.clone(),
                created: now,
                updated: now,
                launched: None,
                phase: Phase::Build,
                deleting: false,
                stuck,
                hidden,
                doomed,
                has_ports: req.has_ports,
                agent: None,
            };
            tracing::info!(server_id = %id, name = %server.name, stuck, doomed, "server created");
            inner.servers.insert(id.clone(), server);
            created.push(id);
        }
    }
    for id in &created {
        super::vm::schedule_boot(state.clone(), id.clone());
    }
    let first = &created[0];
    let server_links = links(&state, "servers", first);
    let body = json!({
        "id": first,
        "links": server_links,
        "OS-DCF:diskConfig": "MANUAL",
        "security_groups": [{"name": "default"}],
        "adminPass": req.admin_pass,
    });
    let mut resp = (StatusCode::ACCEPTED, axum::Json(json!({ "server": body }))).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("{}/compute/v2.1/servers/{first}", state.base()))
    {
        resp.headers_mut().insert("Location", v);
    }
    Ok(resp)
}

async fn delete_server(
    State(state): State<Arc<SimState>>,
    Path(id): Path<String>,
) -> Result<Response, NovaFault> {
    let agent = {
        let mut inner = state.lock();
        let ignore = inner.faults.ignore_deletes == Some(true);
        let s = inner
            .servers
            .get_mut(&id)
            .ok_or_else(|| NovaFault::not_found(&id))?;
        let deleting = s.deleting;
        inner.delete_requests_total += 1;
        if ignore {
            tracing::info!(server_id = %id, "fault: delete answered 204 and ignored");
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        if deleting {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        let s = inner.servers.get_mut(&id).expect("looked up above");
        s.deleting = true;
        s.updated = SystemTime::now();
        s.agent.clone()
    };
    tracing::info!(server_id = %id, agent_pid = ?agent.as_ref().map(|a| a.pid), "server delete requested");
    super::vm::schedule_delete(state.clone(), id, agent);
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn with_server<T>(
    state: &SimState,
    id: &str,
    f: impl FnOnce(&mut Server) -> Result<T, NovaFault>,
) -> Result<T, NovaFault> {
    let mut inner = state.lock();
    let s = inner
        .servers
        .get_mut(id)
        .ok_or_else(|| NovaFault::not_found(id))?;
    f(s)
}

fn not_deleting(s: &Server, action: &str) -> Result<(), NovaFault> {
    if s.deleting {
        return Err(NovaFault::new(
            StatusCode::CONFLICT,
            format!(
                "Cannot '{action}' instance {} while it is in task_state deleting",
                s.id
            ),
        ));
    }
    Ok(())
}

fn parse_body(body: &Bytes) -> Result<Value, NovaFault> {
    serde_json::from_slice(body).map_err(|_| NovaFault::bad("Malformed request body"))
}

async fn get_metadata(
    State(state): State<Arc<SimState>>,
    Path(id): Path<String>,
) -> Result<Response, NovaFault> {
    let md = with_server(&state, &id, |s| Ok(s.metadata.clone()))?;
    Ok(axum::Json(json!({ "metadata": md })).into_response())
}

async fn set_metadata(
    state: &SimState,
    id: &str,
    body: &Bytes,
    replace: bool,
) -> Result<Response, NovaFault> {
    let body = parse_body(body)?;
    let v = body.get("metadata").ok_or_else(|| {
        NovaFault::invalid("metadata", &body, "'metadata' is a required property")
    })?;
    let new = validate_metadata("metadata", v)?;
    let md = with_server(state, id, |s| {
        not_deleting(s, "update_metadata")?;
        let mut merged = if replace {
            BTreeMap::new()
        } else {
            s.metadata.clone()
        };
        merged.extend(new);
        if merged.len() > MAX_METADATA_ITEMS {
            return Err(too_many_metadata());
        }
        s.metadata = merged;
        s.updated = SystemTime::now();
        Ok(s.metadata.clone())
    })?;
    Ok(axum::Json(json!({ "metadata": md })).into_response())
}

async fn replace_metadata(
    State(state): State<Arc<SimState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, NovaFault> {
    set_metadata(&state, &id, &body, true).await
}

async fn merge_metadata(
    State(state): State<Arc<SimState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, NovaFault> {
    set_metadata(&state, &id, &body, false).await
}

async fn get_metadata_item(
    State(state): State<Arc<SimState>>,
    Path((id, key)): Path<(String, String)>,
) -> Result<Response, NovaFault> {
    let value = with_server(&state, &id, |s| {
        s.metadata
            .get(&key)
            .cloned()
            .ok_or_else(|| NovaFault::new(StatusCode::NOT_FOUND, "Metadata item was not found"))
    })?;
    Ok(axum::Json(json!({"meta": { key: value }})).into_response())
}

async fn put_metadata_item(
    State(state): State<Arc<SimState>>,
    Path((id, key)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, NovaFault> {
    let body = parse_body(&body)?;
    let meta = body
        .get("meta")
        .ok_or_else(|| NovaFault::invalid("meta", &body, "'meta' is a required property"))?;
    let item = validate_metadata("meta", meta)?;
    if item.len() != 1 || !item.contains_key(&key) {
        return Err(NovaFault::bad("Request body and URI mismatch"));
    }
    with_server(&state, &id, |s| {
        not_deleting(s, "update_metadata")?;
        if !s.metadata.contains_key(&key) && s.metadata.len() >= MAX_METADATA_ITEMS {
            return Err(too_many_metadata());
        }
        s.metadata.extend(item.clone());
        s.updated = SystemTime::now();
        Ok(())
    })?;
    Ok(axum::Json(json!({ "meta": item })).into_response())
}

async fn delete_metadata_item(
    State(state): State<Arc<SimState>>,
    Path((id, key)): Path<(String, String)>,
) -> Result<Response, NovaFault> {
    with_server(&state, &id, |s| {
        not_deleting(s, "delete_metadata")?;
        s.metadata
            .remove(&key)
            .map(|_| ())
            .ok_or_else(|| NovaFault::new(StatusCode::NOT_FOUND, "Metadata item was not found"))
    })?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn get_tags(
    State(state): State<Arc<SimState>>,
    Extension(mv): Extension<Mv>,
    Path(id): Path<String>,
) -> Result<Response, NovaFault> {
    if !mv.at_least(26) {
        return Err(NovaFault::new(
            StatusCode::NOT_FOUND,
            "The resource could not be found.",
        ));
    }
    let tags = with_server(&state, &id, |s| Ok(s.tags.clone()))?;
    Ok(axum::Json(json!({ "tags": tags })).into_response())
}

async fn limits(State(state): State<Arc<SimState>>, Extension(mv): Extension<Mv>) -> Response {
    let (n, cores, ram) = state.lock().usage();
    let cfg = &state.config;
    let mut absolute = json!({
        "maxServerMeta": MAX_METADATA_ITEMS,
        "maxTotalCores": cfg.quota_cores,
        "maxTotalInstances": cfg.quota_instances,
        "maxTotalKeypairs": 100,
        "maxTotalRAMSize": cfg.quota_ram_mb,
        "maxServerGroups": 10,
        "maxServerGroupMembers": 10,
        "totalCoresUsed": cores,
        "totalInstancesUsed": n,
        "totalRAMUsed": ram,
        "totalServerGroupsUsed": 0,
    });
    if !mv.at_least(36) {
        for (k, v) in [
            ("maxSecurityGroupRules", 20),
            ("maxSecurityGroups", 10),
            ("maxTotalFloatingIps", 10),
            ("totalFloatingIpsUsed", 0),
            ("totalSecurityGroupsUsed", 0),
        ] {
            absolute[k] = json!(v);
        }
    }
    if !mv.at_least(39) {
        absolute["maxImageMeta"] = json!(128);
    }
    if !mv.at_least(57) {
        absolute["maxPersonality"] = json!(5);
        absolute["maxPersonalitySize"] = json!(10240);
    }
    axum::Json(json!({"limits": {"absolute": absolute, "rate": []}})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn microversion_defaults_to_2_1_and_honours_both_headers() {
        assert_eq!(
            negotiate(&headers(&[]), MAX_COMPUTE_MINOR)
                .map(|m| m.0)
                .ok(),
            Some(1)
        );
        let new = headers(&[("OpenStack-API-Version", "volume 3.0, compute 2.52")]);
        assert_eq!(
            negotiate(&new, MAX_COMPUTE_MINOR).map(|m| m.0).ok(),
            Some(52)
        );
        let old = headers(&[("X-OpenStack-Nova-API-Version", "2.37")]);
        assert_eq!(
            negotiate(&old, MAX_COMPUTE_MINOR).map(|m| m.0).ok(),
            Some(37)
        );
        let latest = headers(&[("OpenStack-API-Version", "compute latest")]);
        assert_eq!(
            negotiate(&latest, MAX_COMPUTE_MINOR).map(|m| m.0).ok(),
            Some(MAX_COMPUTE_MINOR)
        );
        // An older cloud: 2.52 is above its maximum.
        let older = headers(&[("OpenStack-API-Version", "compute 2.52")]);
        assert_eq!(
            negotiate(&older, 40).err().map(|f| f.status),
            Some(StatusCode::NOT_ACCEPTABLE)
        );
        assert_eq!(negotiate(&latest, 40).map(|m| m.0).ok(), Some(40));
    }

    #[test]
    fn microversion_out_of_range_is_406_and_garbage_is_400() {
        let high = headers(&[("OpenStack-API-Version", "compute 2.200")]);
        assert_eq!(
            negotiate(&high, MAX_COMPUTE_MINOR).err().map(|f| f.status),
            Some(StatusCode::NOT_ACCEPTABLE)
        );
        let junk = headers(&[("OpenStack-API-Version", "compute two")]);
        assert_eq!(
            negotiate(&junk, MAX_COMPUTE_MINOR).err().map(|f| f.status),
            Some(StatusCode::BAD_REQUEST)
        );
    }

    #[test]
    fn urlencode_matches_python() {
        let q = vec![
            ("name".to_string(), "^vq-a b$".to_string()),
            ("limit".into(), "2".into()),
        ];
        assert_eq!(urlencode(&q), "name=%5Evq-a+b%24&limit=2");
    }
}
