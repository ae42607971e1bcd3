//! The payments demo's HTTP application, shared by `main.rs` and the end-to-end tests.
//!
//! Demo-grade authentication: any bearer token is an account (`Authorization: Bearer acme`), and its
//! tenant is a digest of the token ([`tenant_of`]), never the token itself: tenants are stored in clear
//! and typed on `idemctl` command lines. A real service looks the token up and uses the account's id.
//! `POST /payments` records the charge and its receipt e-mail (an outbox row) in the claim's own
//! transaction (the layer's transactional path): the charge, the receipt, the claim and the stored 201
//! commit together, so no restart or crash charges a key twice or answers 201 without its charge.
//! [`send_receipts`] relays the receipts to the "mail provider" (the `receipts` table).
//! `POST /webhooks/{provider}` is an inbox for signed deliveries: providers whose name starts with `stripe`
//! sign the Stripe way (`Stripe-Signature`), others the Standard Webhooks way (`webhook-id`,
//! `webhook-timestamp`, `webhook-signature`), each sender with its own secret (an unknown sender gets
//! 404); the event id comes from the signed material, an unsigned, forged or stale delivery gets 400/401 and nothing is recorded. An optional
//! `X-Event-Sequence` is recorded, and a re-delivered event (whatever bookkeeping changed in its body) is
//! acknowledged without re-running; the handler's insert commits with the inbox record.
//! Demo-only knobs: `X-Demo-Delay-Ms` slows the handler (to see a 409 for a concurrent retry) and
//! `X-Demo-Fail: 500|400` makes it fail (to see what is stored and what is released).

use std::collections::HashMap;
use std::error::Error;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idemstore::http::{ClaimTx, IdempotencyLayer};
use idemstore::outbox::Drained;
use idemstore::{
    LeaseExpiry, Message, Policy, Received, RunError, SignatureScheme, Store, StoreError, WebhookVerifier,
};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{PgConnection, PgPool};

/// The demo's tables (`charges`, `webhook_events`, `receipts`), separate from the store's own schema
/// (bookkept in sqlx's default `_sqlx_migrations`).
pub static CHARGES: LazyLock<Migrator> = LazyLock::new(|| {
    let embedded = [
        (20261130000002, "charges", include_str!("migrations/20261130000002_charges.sql")),
        (20261130000003, "webhook events", include_str!("migrations/20261130000003_webhook_events.sql")),
        (20261130000004, "receipts", include_str!("migrations/20261130000004_receipts.sql")),
    ];
    // As sqlx's `migrate!` builds them (its checksums: a database it migrated keeps validating).
    let migration = |(version, description, sql): (i64, &'static str, &'static str)| {
        let no_tx = sql.starts_with("-- no-transaction");
        Migration::new(version, description.into(), MigrationType::Simple, sqlx::SqlStr::from_static(sql), no_tx)
    };
    Migrator::with_migrations(embedded.into_iter().map(migration).collect())
});

/// The senders of webhooks when `IDEMSTORE_DEMO_WEBHOOK_SECRETS` is unset, each with its own secret
/// (`whsec_` and base64, which both schemes accept). Public, so never use them outside the demo.
pub const DEMO_WEBHOOK_SECRETS: &str = "stripe=whsec_ZGVtby1vbmx5LXdlYmhvb2stc2VjcmV0LXN0cmlwZS0=,\
    partner=whsec_ZGVtby1vbmx5LXdlYmhvb2stc2VjcmV0LXBhcnRuZXI=,\
    carrier=whsec_ZGVtby1vbmx5LXdlYmhvb2stc2VjcmV0LWNhcnJpZXI=";

#[derive(Clone)]
pub struct App {
    pub store: Store,
    pub metrics: PrometheusHandle,
    pub webhook_senders: WebhookSenders,
}

/// Each webhook sender's signature check, by the name in `/webhooks/{provider}`. A delivery verifies
/// only with its own sender's secret, so a delivery captured from one sender is refused under another's
/// name (with one secret for all, it would be handled again in the other's inbox), and an unknown
/// sender has no inbox.
#[derive(Clone)]
pub struct WebhookSenders(Arc<HashMap<String, WebhookVerifier>>);

impl WebhookSenders {
    /// `provider=secret` pairs, comma-separated: providers named `stripe...` sign the Stripe way, others
    /// the Standard Webhooks way.
    pub fn parse(list: &str) -> Result<Self, Box<dyn Error>> {
        let mut senders = HashMap::new();
        for pair in list.split(',').map(str::trim).filter(|pair| !pair.is_empty()) {
            let (provider, secret) = pair.split_once('=').ok_or(format!("{pair:?} is not provider=secret"))?;
            let (provider, secret) = (provider.trim(), secret.trim());
            let scheme = if provider.starts_with("stripe") {
                SignatureScheme::Stripe
            } else {
                SignatureScheme::StandardWebhooks
            };
            senders.insert(provider.to_owned(), WebhookVerifier::new(scheme, [secret])?);
        }
        if senders.is_empty() {
            return Err("no webhook sender: give provider=secret pairs, comma-separated".into());
        }
        Ok(Self(Arc::new(senders)))
    }

    /// The demo's senders ([`DEMO_WEBHOOK_SECRETS`]).
    pub fn demo() -> Self {
        Self::parse(DEMO_WEBHOOK_SECRETS).expect("the demo's secrets")
    }

    /// `provider`'s signature check, if it is a sender.
    pub fn verifier(&self, provider: &str) -> Option<&WebhookVerifier> {
        self.0.get(provider)
    }
}

/// Applies the store's migrations, then the demo's.
pub async fn migrate(store: &Store) -> Result<(), Box<dyn std::error::Error>> {
    store.migrate().await?;
    CHARGES.run(store.pg_pool()).await?;
    Ok(())
}

/// How `POST /payments` settles its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PaymentsPath {
    /// The charge in the claim's transaction (the default): one commit, never twice.
    Transactional,
    /// The charge in a transaction of its own, the record settled after it under this lease rule: what
    /// an application whose effects live elsewhere gets (`IDEMSTORE_DEMO_PATH=takeover|indeterminate`).
    Plain(LeaseExpiry),
}

pub fn router(app: App) -> Router {
    router_with(app, PaymentsPath::Transactional)
}

pub fn router_with(app: App, path: PaymentsPath) -> Router {
    let idempotency =
        IdempotencyLayer::new(app.store.clone(), |parts: &axum::http::request::Parts| bearer_tenant(&parts.headers))
            .with_key_required();
    let idempotency = match path {
        PaymentsPath::Transactional => idempotency.with_claim_transaction(),
        PaymentsPath::Plain(expiry) => {
            let policy = Policy::builder().lease_expiry(expiry).build().expect("the default policy with a rule");
            idempotency.with_policy(policy)
        }
    };
    Router::new()
        .route("/payments", post(create_payment).route_layer(idempotency))
        .route("/payments/{id}", get(show_payment))
        .route("/webhooks/{provider}", post(receive_webhook))
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(|State(app): State<App>| async move { app.metrics.render() }))
        .with_state(app)
}

fn bearer_tenant(headers: &HeaderMap) -> Option<String> {
    let token = headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ")?.trim();
    (!token.is_empty()).then(|| tenant_of(token))
}

/// The tenant of a bearer token: `acct_` and 64 bits of its SHA-256, standing in for the lookup of a
/// real service (a token that can be guessed can be confirmed from a record; real tokens cannot be).
pub fn tenant_of(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest[..8].iter().fold(String::from("acct_"), |mut tenant, byte| {
        tenant.push_str(&format!("{byte:02x}"));
        tenant
    })
}

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
    customer: String,
}

#[derive(Serialize)]
struct Charge {
    id: i64,
    amount: i64,
    currency: String,
    customer: String,
    created_at: String,
}

/// A row of `CHARGE_COLUMNS`, in their order.
type ChargeRow = (i64, i64, String, String, String);

impl From<ChargeRow> for Charge {
    fn from((id, amount, currency, customer, created_at): ChargeRow) -> Self {
        Self { id, amount, currency, customer, created_at }
    }
}

const CHARGE_COLUMNS: &str = "id, amount, currency, customer, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS created_at";

async fn create_payment(
    State(app): State<App>,
    headers: HeaderMap,
    tx: Option<ClaimTx>,
    Json(payment): Json<NewPayment>,
) -> Response {
    let Some(tenant) = bearer_tenant(&headers) else { return error(StatusCode::UNAUTHORIZED, "missing bearer token") };
    if let Some(delay) = headers.get("x-demo-delay-ms").and_then(|v| v.to_str().ok()?.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    match headers.get("x-demo-fail").and_then(|v| v.to_str().ok()) {
        Some("500") => return error(StatusCode::INTERNAL_SERVER_ERROR, "demo failure (X-Demo-Fail: 500)"),
        Some("400") => return error(StatusCode::BAD_REQUEST, "demo failure (X-Demo-Fail: 400)"),
        _ => {}
    }
    let valid_currency = payment.currency.len() == 3 && payment.currency.bytes().all(|b| b.is_ascii_uppercase());
    if payment.amount <= 0 || !valid_currency || payment.customer.is_empty() {
        return error(StatusCode::BAD_REQUEST, "amount must be positive, currency an ISO code, customer set");
    }
    match record_charge(&app.store, tx, &tenant, &payment).await {
        Ok(charge) => {
            let location = format!("/payments/{}", charge.id);
            (StatusCode::CREATED, [(header::LOCATION, location)], Json(charge)).into_response()
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &format!("could not record the charge: {e}")),
    }
}

/// The charge and its receipt, written in the claim's transaction (the layer commits them with the
/// stored response), or on the plain path in a transaction of their own: either way there is no charge
/// without a receipt and no receipt for a charge that rolled back.
async fn record_charge(
    store: &Store,
    claim: Option<ClaimTx>,
    tenant: &str,
    payment: &NewPayment,
) -> Result<Charge, Box<dyn Error>> {
    match claim {
        Some(mut claim) => insert_charge(store, &mut claim, tenant, payment).await,
        None => {
            let mut tx = store.pg_pool().begin().await?;
            let charge = insert_charge(store, &mut tx, tenant, payment).await?;
            tx.commit().await?;
            Ok(charge)
        }
    }
}

async fn insert_charge(
    store: &Store,
    tx: &mut PgConnection,
    tenant: &str,
    payment: &NewPayment,
) -> Result<Charge, Box<dyn Error>> {
    let insert = format!(
        "INSERT INTO charges (tenant, amount, currency, customer) VALUES ($1, $2, $3, $4) RETURNING {CHARGE_COLUMNS}"
    );
    let charge: Charge = sqlx::query_as::<_, ChargeRow>(sqlx::AssertSqlSafe(insert))
        .bind(tenant)
        .bind(payment.amount)
        .bind(&payment.currency)
        .bind(&payment.customer)
        .fetch_one(&mut *tx)
        .await?
        .into();
    let receipt = Receipt { charge: charge.id, customer: charge.customer.clone(), amount: charge.amount };
    store.outbox().enqueue(tx, RECEIPTS, &receipt).await?;
    Ok(charge)
}

const RECEIPTS: &str = "receipts";

#[derive(Serialize, Deserialize)]
struct Receipt {
    charge: i64,
    customer: String,
    amount: i64,
}

/// One pass of the receipt relay (`main` runs it every half second): each due receipt goes to the mail
/// provider with the outbox row's idempotency key, so a receipt relayed twice (after a crash) is sent once.
pub async fn send_receipts(store: &Store) -> Result<Drained, StoreError> {
    let pool = store.pg_pool().clone();
    store.outbox().with_topics([RECEIPTS]).drain(|message| send_receipt(pool.clone(), message)).await
}

async fn send_receipt(pool: PgPool, message: Message) -> Result<(), Box<dyn Error>> {
    let receipt: Receipt = message.decode()?;
    let sent = sqlx::query(
        "INSERT INTO receipts (idempotency_key, charge_id, customer) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(message.idempotency_key().as_str())
    .bind(receipt.charge)
    .bind(&receipt.customer)
    .execute(&pool)
    .await?;
    if sent.rows_affected() == 1 {
        println!("receipt for charge {} sent to {} ({})", receipt.charge, receipt.customer, message.idempotency_key());
    }
    Ok(())
}

async fn show_payment(State(app): State<App>, headers: HeaderMap, Path(id): Path<i64>) -> Response {
    let Some(tenant) = bearer_tenant(&headers) else { return error(StatusCode::UNAUTHORIZED, "missing bearer token") };
    let select = format!("SELECT {CHARGE_COLUMNS} FROM charges WHERE id = $1 AND tenant = $2");
    let charge = sqlx::query_as::<_, ChargeRow>(sqlx::AssertSqlSafe(select))
        .bind(id)
        .bind(&tenant)
        .fetch_optional(app.store.pg_pool())
        .await;
    match charge {
        Ok(Some(row)) => Json(Charge::from(row)).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, "no such payment"),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

async fn receive_webhook(
    State(app): State<App>,
    Path(provider): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let Some(verifier) = app.webhook_senders.verifier(&provider) else {
        return error(StatusCode::NOT_FOUND, "no such webhook sender");
    };
    let inbox = match app.store.inbox(provider.clone()) {
        Ok(inbox) => inbox.verified_by(verifier.clone()),
        Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let delivery = match inbox.verify(&headers, &body) {
        Ok(delivery) => delivery,
        Err(e) if e.is_unauthorized() => return error(StatusCode::UNAUTHORIZED, &e.to_string()),
        Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let Ok(event) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "the event is not JSON");
    };
    let sequence = headers.get("x-event-sequence").and_then(|v| v.to_str().ok()?.parse().ok());
    let handle = record_event(provider.clone(), delivery.event_id.clone());
    // The delivery is bound to this inbox: no other sender's inbox would take it.
    match inbox.receive_in_tx(&delivery, sequence, &event, handle).await {
        Ok(Received::Executed(_)) => Json(json!({ "status": "processed" })).into_response(),
        Ok(Received::Replayed { .. }) => Json(json!({ "status": "duplicate" })).into_response(),
        Ok(Received::InFlight { .. }) => error(StatusCode::CONFLICT, "this event is being handled; retry later"),
        Ok(Received::QuotaExceeded { retry_after, .. }) => {
            let mut refused = error(StatusCode::TOO_MANY_REQUESTS, "this sender reached its quota; retry later");
            let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            refused.headers_mut().insert(header::RETRY_AFTER, seconds.max(1).into());
            refused
        }
        Ok(_) => error(StatusCode::CONFLICT, "this event awaits an operator"),
        Err(RunError::Store(idemstore::StoreError::Input(e))) => error(StatusCode::BAD_REQUEST, &e.to_string()),
        // Handled before, its outcome unreadable (encryption key retired): a retry would get the same.
        Err(RunError::Store(e @ idemstore::StoreError::Encryption(_))) => {
            error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// The webhook handler: its insert commits with the inbox record, so the event is recorded exactly once
/// even if the process dies between the two.
fn record_event(
    provider: String,
    event_id: String,
) -> impl for<'c> FnOnce(&'c mut sqlx::PgConnection) -> idemstore::TxFuture<'c, String, sqlx::Error> {
    move |tx| {
        Box::pin(async move {
            sqlx::query("INSERT INTO webhook_events (provider, event_id) VALUES ($1, $2)")
                .bind(provider)
                .bind(event_id)
                .execute(&mut *tx)
                .await
                .map(|_| String::from("processed"))
        })
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}
