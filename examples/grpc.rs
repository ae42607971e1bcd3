//! The `Idempotency-Key` layer outside axum: a tonic gRPC server whose unary `Create` call creates a
//! charge once per key, however often a client retries it. The charge is written in the claim's
//! transaction (`with_claim_transaction`, `ClaimTransaction` in the request's extensions), so the claim,
//! the charge and the stored answer commit together or not at all.
//!
//! ```text
//! cargo run --example grpc
//! ```
//! Uses `DATABASE_URL` and `REDIS_URL` when set; otherwise starts throwaway servers on loopback and
//! stops them on exit. The service is written by hand (no `.proto` build step) so that the example needs
//! nothing beyond crates.
//!
//! What gRPC clients get: the key comes from the `idempotency-key` metadata; a retry after completion
//! gets the stored response (its `grpc-status` trailer included) with `idempotent-replayed: true`
//! metadata; the layer's own refusals (in flight, mismatch, unavailable) are HTTP answers, which tonic
//! clients see as a `Status` (409 as `Unknown`, 503 as `Unavailable`).
//!
//! The client side: `idemstore_client::IdempotencyGrpcLayer` around the channel keeps the call's key
//! and message, and retries as the server asks (`UNAVAILABLE`, the layer's 503 with `Retry-After`, a
//! call in flight), so one `Create` is one charge however the network behaves.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::request::Parts;
use idemstore::Store;
use idemstore::http::{ClaimTransaction, IdempotencyLayer};
use idemstore_client::{IdempotencyGrpcLayer, IdempotencyMiddleware};
use idemstore_testkit::LocalServers;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;
use tower::util::BoxCloneService;
use tower::{BoxError, Layer as _, ServiceExt as _};

/// `CreateCharge { amount = 1 }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateCharge {
    #[prost(int64, tag = "1")]
    pub amount: i64,
}

/// `Charge { id = 1, amount = 2 }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Charge {
    #[prost(int64, tag = "1")]
    pub id: i64,
    #[prost(int64, tag = "2")]
    pub amount: i64,
}

/// The gRPC method's path.
pub const CREATE: &str = "/charges.Charges/Create";

/// The `charges.Charges` service: one durable insert per executed call.
#[derive(Clone)]
pub struct Charges;

impl NamedService for Charges {
    const NAME: &'static str = "charges.Charges";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<http::Request<Body>> for Charges {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let charges = self.clone();
        Box::pin(async move {
            if request.uri().path() != CREATE {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            Ok(Grpc::new(ProstCodec::default()).unary(charges, request).await)
        })
    }
}

impl UnaryService<CreateCharge> for Charges {
    type Response = Charge;
    type Future = BoxFuture<Result<Response<Charge>, Status>>;

    fn call(&mut self, request: Request<CreateCharge>) -> Self::Future {
        Box::pin(async move {
            let metadata = request.metadata();
            let account = metadata.get("x-account").and_then(|v| v.to_str().ok()).map(str::to_owned);
            // For the tests: a transient failure (released, so a retry runs again), a refusal (stored
            // and replayed with its code), or a slow success (a retry meets it in flight).
            match metadata.get("x-behave").map(|v| v.as_bytes()) {
                Some(b"unavailable") => return Err(Status::unavailable("the ledger is busy; retry")),
                Some(b"invalid") => return Err(Status::invalid_argument("the amount is not allowed")),
                Some(b"slow") => tokio::time::sleep(std::time::Duration::from_millis(1500)).await,
                _ => {}
            }
            // The layer's transaction, which commits the claim and the stored answer with this insert.
            let claim = request.extensions().get::<ClaimTransaction>().cloned();
            let mut tx = claim.as_ref().and_then(ClaimTransaction::lock).ok_or_else(|| Status::internal("no claim"))?;
            let amount = request.into_inner().amount;
            let insert = "INSERT INTO grpc_charges (account, amount) VALUES ($1, $2) RETURNING id";
            let id: i64 = sqlx::query_scalar(insert)
                .bind(account)
                .bind(amount)
                .fetch_one(&mut *tx)
                .await
                .map_err(|error| Status::unavailable(error.to_string()))?;
            Ok(Response::new(Charge { id, amount }))
        })
    }
}

/// The tenant: set by the authentication in front of this service (here, the `x-account` metadata).
fn account(request: &Parts) -> Option<String> {
    request.headers.get("x-account")?.to_str().ok().map(str::to_owned)
}

/// Serves `charges.Charges` behind the layer on a free loopback port.
pub async fn serve(store: Store) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let table =
        "CREATE TABLE IF NOT EXISTS grpc_charges (id bigserial PRIMARY KEY, account text, amount bigint NOT NULL)";
    sqlx::raw_sql(table).execute(store.pg_pool()).await?;
    let layer = IdempotencyLayer::new(store, account as fn(&Parts) -> Option<String>)
        .with_key_required()
        .with_claim_transaction();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let server = Server::builder().layer(layer).add_service(Charges);
    tokio::spawn(server.serve_with_incoming(TcpIncoming::from(listener)));
    Ok(address)
}

/// A client of the service, over any transport: a channel, or one wrapped in layers.
pub type Client = tonic::client::Grpc<BoxCloneService<http::Request<Body>, http::Response<Body>, BoxError>>;

/// A channel to the service.
pub async fn channel(address: SocketAddr) -> Result<Channel, Status> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    endpoint.connect().await.map_err(|e| Status::unavailable(e.to_string()))
}

/// A client over `transport`.
pub fn client<T>(transport: T) -> Client
where
    T: tower::Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    T::Error: Into<BoxError>,
    T::Future: Send + 'static,
{
    tonic::client::Grpc::new(BoxCloneService::new(transport.map_err(Into::into)))
}

/// One `Create` call with `key` as its `idempotency-key`, asking the service to behave as `behave` says
/// (`unavailable`, `invalid` or `slow`); also says whether the answer was a replay.
pub async fn call(
    client: &mut Client,
    account: &str,
    key: &str,
    amount: i64,
    behave: Option<&str>,
) -> Result<(Charge, bool), Status> {
    client.ready().await.map_err(|e| Status::unavailable(e.to_string()))?;
    let mut request = Request::new(CreateCharge { amount });
    let metadata = request.metadata_mut();
    metadata.insert("idempotency-key", key.parse().map_err(|_| Status::invalid_argument("key"))?);
    metadata.insert("x-account", account.parse().map_err(|_| Status::invalid_argument("account"))?);
    if let Some(behave) = behave {
        metadata.insert("x-behave", behave.parse().map_err(|_| Status::invalid_argument("behave"))?);
    }
    let path = http::uri::PathAndQuery::from_static(CREATE);
    let response = client.unary(request, path, ProstCodec::<CreateCharge, Charge>::default()).await?;
    let replayed = response.metadata().get("idempotent-replayed").is_some_and(|v| v == "true");
    Ok((response.into_inner(), replayed))
}

/// One `Create` call on a channel of its own, one attempt (no client layer).
pub async fn create(address: SocketAddr, account: &str, key: &str, amount: i64) -> Result<(Charge, bool), Status> {
    create_behaving(address, account, key, amount, None).await
}

/// [`create`], asking the service to behave as `behave` says.
pub async fn create_behaving(
    address: SocketAddr,
    account: &str,
    key: &str,
    amount: i64,
    behave: Option<&str>,
) -> Result<(Charge, bool), Status> {
    call(&mut client(channel(address).await?), account, key, amount, behave).await
}

/// How many charges the service created for `account`.
pub async fn charges_of(store: &Store, account: &str) -> Result<i64, sqlx::Error> {
    let count = sqlx::query_scalar("SELECT count(*) FROM grpc_charges WHERE account = $1").bind(account);
    count.fetch_one(store.pg_pool()).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let servers = LocalServers::from_env()?;
    let store = servers.store_builder().build()?;
    store.migrate().await?;
    let address = serve(store.clone()).await?;
    let key = format!("charge-{}", std::process::id());
    sqlx::query("DELETE FROM grpc_charges WHERE account = 'acct-1'").execute(store.pg_pool()).await.ok();
    // The client side of the contract: the same key and message on every attempt, retries as the
    // server asks, for the one method that needs them.
    let retries = IdempotencyGrpcLayer::new(IdempotencyMiddleware::new(), [CREATE]);
    let mut charges = client(retries.layer(channel(address).await?));
    let (first, replayed) = call(&mut charges, "acct-1", &key, 1200, None).await?;
    println!("first call: charge {} of {} (replayed: {replayed})", first.id, first.amount);
    let (retry, replayed) = call(&mut charges, "acct-1", &key, 1200, None).await?;
    println!("retry:      charge {} of {} (replayed: {replayed})", retry.id, retry.amount);
    let reused = call(&mut charges, "acct-1", &key, 9900, None).await;
    println!("same key, another amount: {:?}", reused.map_err(|status| status.code()));
    let rows = charges_of(&store, "acct-1").await?;
    println!("charges created: {rows}");
    if first != retry || !replayed || rows != 1 {
        return Err("the retry was not a replay of the one charge".into());
    }
    drop(servers);
    Ok(())
}
