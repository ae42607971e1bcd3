//! A process that dies mid-request. The subject's app is served by a child process (this binary with
//! `--serve`) on the same Postgres and Redis, and killed with SIGKILL once a request is inside the
//! handler: nothing of its owner runs after that (no drop code, no lease renewal), as after a real crash.
//! An in-process stand-in cannot do this: a dropped future is a cancelled task, which idemstore answers
//! by giving the key up at once, and a leaked one keeps its lease-renewing task alive.

use std::net::SocketAddr;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::Error;
use crate::client::{BODY, Client};
use crate::subjects::{self, CRASH_POINT, Subject};

/// What the child prints once a request has reached the handler.
const AT_CRASH_POINT: &str = "at the crash point";

/// Sends `key` from `client` (its tenant and session) to a child serving `subject`, and kills the child
/// once the request is in the handler.
pub async fn kill_owner_mid_request(
    client: &Client,
    subject: Subject,
    postgres_url: &str,
    redis_url: &str,
    key: &str,
) -> Result<(), Error> {
    let subject_arg = clap::ValueEnum::to_possible_value(&subject).ok_or("a subject has a name")?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--serve", subject_arg.get_name(), "--postgres-url", postgres_url, "--redis-url", redis_url])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("the child's stdout")?).lines();
    let address: SocketAddr = lines.next_line().await?.ok_or("the child printed no address")?.parse()?;
    let client = client.pointed_at(address);
    let key = key.to_owned();
    let request = tokio::spawn(async move { client.charge(&key, BODY, &[("x-crash", "1")]).await });
    if lines.next_line().await?.as_deref() != Some(AT_CRASH_POINT) {
        return Err("the child never reached the crash point".into());
    }
    child.kill().await?;
    let answer = request.await?;
    match answer.status {
        None => Ok(()),
        Some(status) => Err(format!("the killed owner's request was answered {status}").into()),
    }
}

/// The child's side: serves `subject` and tells the parent its address and each arrival at the crash
/// point, until it is killed.
pub async fn serve(subject: Subject, postgres_url: &str, redis_url: &str) -> Result<(), Error> {
    let pg = sqlx::PgPool::connect(postgres_url).await?;
    let app = subjects::start(subject, &pg, redis_url).await?;
    println!("{}", app.address);
    loop {
        CRASH_POINT.notified().await;
        println!("{AT_CRASH_POINT}");
    }
}
