//! The one HTTP client every subject meets: a tenant's bearer token, and its session cookie where the
//! subject needs one.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::Error;
use crate::subjects::Subject;

/// The body every charge request sends unless a scenario changes it: the one `benches/http/wrk.lua`
/// sends, so that keys prepared here are replayed there.
pub const BODY: &str = r#"{"amount":1250,"currency":"eur","customer":"cus_bench","description":"benchmark charge"}"#;

/// How long a client waits for an answer.
pub const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    tenant: String,
    cookie: Option<String>,
}

/// What came back, or `None` if nothing did within the client's timeout.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: Option<u16>,
    pub body: String,
    pub elapsed: Duration,
}

impl Client {
    /// A client of `subject`'s app at `address` for `tenant`, logged in where the subject needs a session.
    pub async fn new(address: SocketAddr, subject: Subject, tenant: &str) -> Result<Self, Error> {
        let http = reqwest::Client::builder().timeout(TIMEOUT).build()?;
        let mut client = Client { http, base: format!("http://{address}"), tenant: tenant.to_owned(), cookie: None };
        if subject.needs_session() {
            client.cookie = Some(client.login().await?);
        }
        Ok(client)
    }

    async fn login(&self) -> Result<String, Error> {
        let response = self
            .http
            .post(format!("{}/login", self.base))
            .bearer_auth(&self.tenant)
            .send()
            .await?
            .error_for_status()?;
        let set_cookie = response.headers().get("set-cookie").ok_or("login set no cookie")?.to_str()?;
        Ok(set_cookie.split(';').next().unwrap_or_default().to_owned())
    }

    /// The `Cookie` header this client sends, if any (for wrk).
    pub fn cookie(&self) -> Option<&str> {
        self.cookie.as_deref()
    }

    /// The same tenant and session, sending to another process serving the same subject.
    pub fn pointed_at(&self, address: SocketAddr) -> Self {
        Client { base: format!("http://{address}"), ..self.clone() }
    }

    /// Waits until the app answers a fresh key with 201 (at most 5 s): each scenario starts from a subject
    /// that has got over the previous scenario's faults, so that its first request is no casualty of them.
    pub async fn ready(&self, key: &str) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut attempt = 0;
        loop {
            let answer = self.charge(&format!("{key}-{attempt}"), BODY, &[]).await;
            match answer.status {
                Some(201) => return Ok(()),
                _ if Instant::now() > deadline => return Err(format!("not ready: {answer:?}").into()),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
            attempt += 1;
        }
    }

    /// POSTs a charge with `key` and `body`, and `extra` headers.
    pub async fn charge(&self, key: &str, body: &str, extra: &[(&str, &str)]) -> Answer {
        let mut request = self
            .http
            .post(format!("{}/charges", self.base))
            .bearer_auth(&self.tenant)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(body.to_owned());
        if let Some(cookie) = &self.cookie {
            request = request.header("cookie", cookie);
        }
        for (name, value) in extra {
            request = request.header(*name, *value);
        }
        let started = Instant::now();
        let (status, body) = match request.send().await {
            Ok(response) => (Some(response.status().as_u16()), response.text().await.unwrap_or_default()),
            Err(_) => (None, String::new()),
        };
        Answer { status, body, elapsed: started.elapsed() }
    }
}
