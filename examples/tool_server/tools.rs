//! The tool server's one side-effecting tool, `transfer`, safe for an agent to call again: the key of a
//! call is minted from the agent's run, the tool's name and the arguments that decide what it does
//! (`IdempotencyKey::for_tool_call`), never from the call id the model gives each turn, so a call
//! emitted again (after a timeout, a restart, a model that retries) is answered from the first one's
//! record, and the result tells the model it was a replay.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use idemstore::{FingerprintOptions, IdempotencyKey, Policy, RunOptions, RunOutcome, Scope, Store};
use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, JsonObject, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Value, json};

/// The request `_meta` field that names the agent's run (or conversation). An agent framework sets it on
/// every call of one run; without it, the calls of one connection are one run.
pub const RUN_META: &str = "io.idemstore/run";

/// The fields that decide what a transfer does; the memo is free text a model rewords between calls.
const DECIDING_FIELDS: [&str; 2] = ["/to", "/amount"];

/// The server: the store that holds the calls' records, and the run of calls that name none.
#[derive(Clone)]
pub struct Tools {
    store: Store,
    tenant: String,
    connection_run: Arc<str>,
    /// The deciding fields, compared for the key and the payload alike.
    compared: FingerprintOptions,
    options: Arc<RunOptions>,
}

impl Tools {
    /// A server whose records belong to `tenant` (the agent's owner: one tenant never sees another's).
    pub fn new(store: Store, tenant: impl Into<String>) -> Result<Self, idemstore::InputError> {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_nanos());
        let compared =
            DECIDING_FIELDS.iter().try_fold(FingerprintOptions::default(), |o, field| o.compare_only(field))?;
        let policy =
            Policy::builder().fingerprint(compared.clone()).build().expect("the default policy with its fields");
        Ok(Self {
            store,
            tenant: tenant.into(),
            connection_run: format!("connection-{}-{nanos:x}", std::process::id()).into(),
            compared,
            options: Arc::new(RunOptions::default().policy(policy)),
        })
    }

    /// The table the transfers are written to.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        let create = "CREATE TABLE IF NOT EXISTS tool_transfers (
            id bigserial PRIMARY KEY, run text NOT NULL, recipient text NOT NULL, amount bigint NOT NULL)";
        sqlx::query(create).execute(self.store.pg_pool()).await.map(drop)
    }

    /// How many transfers a run made.
    #[allow(dead_code, reason = "the test reads it; the server does not")]
    pub async fn transfers(&self, run: &str) -> Result<i64, sqlx::Error> {
        let count = sqlx::query_scalar("SELECT count(*) FROM tool_transfers WHERE run = $1").bind(run);
        count.fetch_one(self.store.pg_pool()).await
    }

    fn transfer_tool() -> Tool {
        let schema = json!({
            "type": "object",
            "properties": {
                "to": { "type": "string", "description": "the recipient's account" },
                "amount": { "type": "integer", "description": "in cents" },
                "memo": { "type": "string" }
            },
            "required": ["to", "amount"]
        });
        let Value::Object(schema) = schema else { unreachable!("an object") };
        let description = "Transfers money once. Calling it again with the same recipient and amount in this \
                           run does not transfer again: the result says it was already made.";
        Tool::new("transfer", description, schema)
    }

    /// The transfer, once per (run, recipient, amount): what the model reads back.
    async fn transfer(&self, run: &str, arguments: JsonObject) -> CallToolResult {
        let (Some(to), Some(amount)) =
            (arguments.get("to").and_then(Value::as_str), arguments.get("amount").and_then(Value::as_i64))
        else {
            return failed("transfer takes a recipient `to` (text) and an `amount` (an integer, in cents)");
        };
        let payload = Value::Object(arguments.clone());
        let key = serde_json::to_vec(&payload).map_err(|e| e.to_string()).and_then(|bytes| {
            IdempotencyKey::for_tool_call(run, "transfer", &bytes, &self.compared).map_err(|e| e.to_string())
        });
        let (key, scope) = match (key, Scope::new(self.tenant.as_str(), "tool transfer")) {
            (Ok(key), Ok(scope)) => (key, scope),
            (Err(error), _) => return failed(&error),
            (_, Err(error)) => return failed(&error.to_string()),
        };
        let work = || async {
            let insert = "INSERT INTO tool_transfers (run, recipient, amount) VALUES ($1, $2, $3) RETURNING id";
            let id: i64 =
                sqlx::query_scalar(insert).bind(run).bind(to).bind(amount).fetch_one(self.store.pg_pool()).await?;
            Ok::<_, sqlx::Error>(json!({ "transfer": id, "to": to, "amount": amount }))
        };
        let outcome = self.store.run_once_with(&scope, &key, &payload, &self.options, work).await;
        match outcome {
            Ok(RunOutcome::Executed(receipt)) => answered(receipt, false, "Transferred"),
            Ok(RunOutcome::Replayed(receipt)) => answered(
                receipt,
                true,
                "Already transferred earlier in this run; nothing was transferred again. The receipt of that transfer",
            ),
            Ok(RunOutcome::InFlight { .. }) => {
                failed("this transfer is being made right now; call again in a few seconds")
            }
            Ok(other) => failed(&format!("the transfer was not made: {other:?}")),
            Err(error) => failed(&format!("the transfer was not made: {error}")),
        }
    }
}

/// The tool's answer: the receipt, with `replayed` saying whether this call made the transfer.
fn answered(receipt: Value, replayed: bool, said: &str) -> CallToolResult {
    let mut result = CallToolResult::success(vec![ContentBlock::text(format!("{said}: {receipt}"))]);
    result.structured_content = Some(json!({ "receipt": receipt, "replayed": replayed }));
    result
}

fn failed(why: &str) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(why.to_owned())])
}

impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_instructions("`transfer` moves money once per run, recipient and amount, however often it is called.")
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![Self::transfer_tool()]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if request.name != "transfer" {
            return Err(ErrorData::invalid_params(format!("no tool named {:?}", request.name), None));
        }
        // The request's `_meta` reaches the handler in its context.
        let run = context.meta.0.0.get(RUN_META).and_then(Value::as_str);
        let run = run.map_or_else(|| self.connection_run.to_string(), str::to_owned);
        Ok(self.transfer(&run, request.arguments.unwrap_or_default()).await.into())
    }
}
