//! An MCP tool server (stdio) whose side-effecting tool runs once per agent run and arguments, however
//! often the agent calls it, and says so in its result (`replayed`).
//!
//! ```text
//! cargo run --example tool_server
//! ```
//! An MCP client starts it as a child process and speaks the protocol on its stdin and stdout. Uses
//! `DATABASE_URL` and `REDIS_URL` when set; otherwise starts throwaway servers on loopback (announced on
//! stderr) and stops them on exit. Set `_meta["io.idemstore/run"]` on each call to the agent's run id:
//! calls that name none are one run per connection.

mod tools;

use std::error::Error;

use idemstore_testkit::LocalServers;
use rmcp::ServiceExt;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let servers = LocalServers::from_env()?;
    let store = servers.store_builder().build()?;
    store.migrate().await?;
    let tools = tools::Tools::new(store.clone(), "agent-owner")?;
    tools.migrate().await?;
    let running = tools.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    store.shutdown().await;
    drop(servers);
    Ok(())
}
