//! The `Idempotency-Key` layer outside axum: a tonic gRPC server whose unary `Create` call creates a
//! charge once per key, however often a client retries it.
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

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::request::Parts;
use idemstore::Store;
use idemstore::http::IdempotencyLayer;
use idemstore::testkit::LocalServers;
use sqlx::PgPool;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

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
pub struct Charges {
    pool: PgPool,
}

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
        let pool = self.pool.clone();
        Box::pin(async move {
            let metadata = request.metadata();
            let account = metadata.get("x-account").and_then(|v| v.to_str().ok()).map(str::to_owned);
            // For the tests: a transient failure (released, so a retry runs again) or a refusal (stored
            // and replayed with its code).
            match metadata.get("x-fail").map(|v| v.as_bytes()) {
                Some(b"unavailable") => return Err(Status::unavailable("the ledger is busy; retry")),
                Some(b"invalid") => return Err(Status::invalid_argument("the amount is not allowed")),
                _ => {}
            }
            let amount = request.into_inner().amount;
            let insert = "INSERT INTO grpc_charges (account, amount) VALUES ($1, $2) RETURNING id";
            let id: i64 = sqlx::query_scalar(insert)
                .bind(account)
                .bind(amount)
                .fetch_one(&pool)
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
    let charges = Charges { pool: store.pg_pool().clone() };
    let layer = IdempotencyLayer::new(store, account as fn(&Parts) -> Option<String>).with_key_required();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let server = Server::builder().layer(layer).add_service(charges);
    tokio::spawn(server.serve_with_incoming(TcpIncoming::from(listener)));
    Ok(address)
}

/// One `Create` call with `key` as its `idempotency-key`; also says whether it was a replay.
pub async fn create(address: SocketAddr, account: &str, key: &str, amount: i64) -> Result<(Charge, bool), Status> {
    create_failing(address, account, key, amount, None).await
}

/// [`create`], asking the service to fail with `fail` (`unavailable` or `invalid`).
pub async fn create_failing(
    address: SocketAddr,
    account: &str,
    key: &str,
    amount: i64,
    fail: Option<&str>,
) -> Result<(Charge, bool), Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .connect()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.map_err(|e| Status::unavailable(e.to_string()))?;
    let mut request = Request::new(CreateCharge { amount });
    let metadata = request.metadata_mut();
    metadata.insert("idempotency-key", key.parse().map_err(|_| Status::invalid_argument("key"))?);
    metadata.insert("x-account", account.parse().map_err(|_| Status::invalid_argument("account"))?);
    if let Some(fail) = fail {
        metadata.insert("x-fail", fail.parse().map_err(|_| Status::invalid_argument("fail"))?);
    }
    let path = http::uri::PathAndQuery::from_static(CREATE);
    let response = client.unary(request, path, ProstCodec::<CreateCharge, Charge>::default()).await?;
    let replayed = response.metadata().get("idempotent-replayed").is_some_and(|v| v == "true");
    Ok((response.into_inner(), replayed))
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
    let (first, replayed) = create(address, "acct-1", &key, 1200).await?;
    println!("first call: charge {} of {} (replayed: {replayed})", first.id, first.amount);
    let (retry, replayed) = create(address, "acct-1", &key, 1200).await?;
    println!("retry:      charge {} of {} (replayed: {replayed})", retry.id, retry.amount);
    let reused = create(address, "acct-1", &key, 9900).await;
    println!("same key, another amount: {:?}", reused.map_err(|status| status.code()));
    let rows = charges_of(&store, "acct-1").await?;
    println!("charges created: {rows}");
    if first != retry || !replayed || rows != 1 {
        return Err("the retry was not a replay of the one charge".into());
    }
    drop(servers);
    Ok(())
}
