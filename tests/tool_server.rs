//! The MCP tool server example (`examples/tool_server`) driven by a real MCP client over an in-memory
//! duplex: an agent's call emitted again, with a new call id and a reworded memo, transfers once and is
//! told it was a replay; another run or another amount is another transfer. Real Redis and Postgres,
//! both modes.

use crate::support;

use idemstore::Mode;
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult, RequestMetaObject};
use serde_json::{Value, json};
use support::Harness;

#[path = "../examples/tool_server/tools.rs"]
mod tools;

suite!(an_agents_repeated_tool_call_transfers_once_and_is_told_so);

/// A `transfer` call of `run` with these arguments (a call id of its own each time, as a model gives).
fn call(run: &str, call_id: u32, arguments: Value) -> CallToolRequestParams {
    let Value::Object(arguments) = arguments else { panic!("an object") };
    let mut params = CallToolRequestParams::new("transfer");
    params.arguments = Some(arguments);
    let meta = json!({ tools::RUN_META: run, "call_id": format!("call_{call_id}") });
    params.meta = Some(serde_json::from_value::<RequestMetaObject>(meta).expect("a meta object"));
    params
}

fn replayed(result: &CallToolResult) -> bool {
    let structured = result.structured_content.as_ref().expect("a structured result");
    structured["replayed"].as_bool().expect("replayed is a flag")
}

async fn an_agents_repeated_tool_call_transfers_once_and_is_told_so(mode: Mode) {
    let h = Harness::start(mode).await;
    let tools = tools::Tools::new(h.store.clone(), h.id()).expect("the tool server");
    tools.migrate().await.expect("its table");
    let (server_end, client_end) = tokio::io::duplex(64 * 1024);
    let (server, client) = tokio::join!(tools.clone().serve(server_end), ().serve(client_end));
    let (server, client) = (server.expect("the server starts"), client.expect("the client connects"));
    let listed = client.list_tools(None).await.expect("tools/list");
    assert_eq!(listed.tools.iter().map(|tool| tool.name.as_ref()).collect::<Vec<_>>(), ["transfer"]);

    let run = format!("run-{}", h.id());
    let first = client.call_tool(call(&run, 1, json!({"to": "ana", "amount": 500, "memo": "rent"}))).await;
    let first = first.expect("tools/call");
    assert_eq!((first.is_error, replayed(&first)), (Some(false), false), "{first:?}");
    let again = json!({"memo": "the rent, as asked", "amount": 500, "to": "ana"});
    let second = client.call_tool(call(&run, 2, again)).await.expect("tools/call");
    assert!(replayed(&second), "{second:?}");
    let said = format!("{:?}", second.content);
    assert!(said.contains("nothing was transferred again"), "the model reads it: {said}");
    let receipt = |result: &CallToolResult| result.structured_content.as_ref().map(|s| s["receipt"].clone());
    assert_eq!(receipt(&second), receipt(&first), "the first transfer's receipt");
    assert_eq!(tools.transfers(&run).await.expect("count"), 1, "{first:?}");

    let other_amount = client.call_tool(call(&run, 3, json!({"to": "ana", "amount": 501}))).await.expect("tools/call");
    let other_run = format!("{run}-b");
    let other = client.call_tool(call(&other_run, 4, json!({"to": "ana", "amount": 500}))).await.expect("tools/call");
    assert!(!replayed(&other_amount) && !replayed(&other));
    assert_eq!(
        (tools.transfers(&run).await.expect("count"), tools.transfers(&other_run).await.expect("count")),
        (2, 1)
    );

    let refused = client.call_tool(call(&run, 5, json!({"to": "ana"}))).await.expect("tools/call");
    assert_eq!(refused.is_error, Some(true), "a call without an amount is the model's to fix: {refused:?}");
    client.cancel().await.expect("the client stops");
    server.cancel().await.expect("the server stops");
}
