//! The load generator's `POST /v1/send`: plain HTTP/1 connections to the gateway, kept open and
//! reused one request at a time, each request carrying its host's bearer and client address, as
//! wrk's would. The load generator shares the machine's two cores with the gateway it measures,
//! so what it spends per send is taken from the gateway: through the host SDK's client (reqwest
//! with its pool, timer and URL handling, the reply parsed into a JSON tree) it took 40-41% of a
//! core at 1,000 flows (docs/benchmarks.md, round 18). Everything else (log-ins, registrations,
//! device lists, a session renewed after a 401) still goes through the host SDK.

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST, HeaderValue};
use serde::Deserialize;
use serde_json::Value;

use crate::population::Host;

/// As long as the load generator's host SDK client waits for an answer (`main.rs`), connecting
/// included.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// Idle connections to one gateway, reused last in, first out: a closed loop of N workers keeps N
/// connections open, and an open loop as many as it has requests in flight. One the gateway has
/// closed (it closes a connection idle for 10 s) is dropped when next taken, and a request that
/// was never written goes on a new connection, as reqwest's pool does.
pub struct Lines {
    /// `host:port`, dialled and sent as `Host`.
    authority: String,
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
}

/// What the gateway answers a send with, as far as the load generator reads it.
#[derive(Deserialize)]
struct Reply {
    #[serde(default)]
    results: Vec<Outcome>,
}

#[derive(Deserialize)]
struct Outcome {
    #[serde(default)]
    status: Option<String>,
}

#[derive(Deserialize)]
struct Refusal {
    error: String,
}

impl Lines {
    /// Connections to the gateway at `base` (`http://host:port`).
    pub fn new(base: &str) -> anyhow::Result<Self> {
        let authority = base
            .strip_prefix("http://")
            .ok_or_else(|| anyhow::anyhow!("the load generator speaks plain HTTP: {base}"))?
            .trim_end_matches('/')
            .to_owned();
        Ok(Self {
            authority,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Posts `body` as `host`; Ok when every recipient is `queued`, else the error's kind as the
    /// rows count it (`"503 busy"`, `"transport"`, `"status rate_limited"`, ...). A 401 is retried
    /// once through the host SDK, which proves the key again and keeps the new session.
    pub async fn send(&self, host: &Host, body: &Value) -> Result<(), String> {
        let bytes = Bytes::from(serde_json::to_vec(body).map_err(|e| e.to_string())?);
        let (status, reply) =
            match tokio::time::timeout(ANSWER_WITHIN, self.post(host, bytes)).await {
                Ok(answer) => answer?,
                Err(_) => return Err("timeout".into()),
            };
        if status == 401 {
            let retried = host
                .client
                .call(reqwest::Method::POST, "/v1/send", Some(body))
                .await;
            // Whatever the retry's answer, the SDK holds the session it renewed.
            host.renewed().await;
            let reply = retried.map_err(|e| crate::scenarios::error_kind(&e))?;
            return all_queued(serde_json::from_value(reply).map_err(|_| "malformed reply")?);
        }
        if status != 200 {
            let code = serde_json::from_slice::<Refusal>(&reply)
                .map_or_else(|_| "unknown".to_owned(), |r| r.error);
            return Err(format!("{status} {code}"));
        }
        all_queued(serde_json::from_slice(&reply).map_err(|_| "malformed reply")?)
    }

    /// One request on an open idle connection (or a new one); the connection goes back to the
    /// idle ones unless it failed or closed.
    async fn post(&self, host: &Host, body: Bytes) -> Result<(u16, Bytes), String> {
        let mut request = hyper::Request::post("/v1/send")
            .header(HOST, &self.authority)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(AUTHORIZATION, host.bearer())
            .header("x-forwarded-for", host.forwarded.clone())
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let (mut line, mut dialled) = match self.take_open() {
            Some(line) => (line, false),
            None => (self.dial().await?, true),
        };
        let response = loop {
            let unsent = match line.ready().await {
                Ok(()) => match line.try_send_request(request).await {
                    Ok(response) => break response,
                    Err(mut failed) => failed.take_message(),
                },
                Err(_) => None,
            };
            // Once on a new connection, and only if the request was never written: a request
            // the gateway may have read is not sent twice.
            match unsent {
                Some(again) if !dialled => request = again,
                _ => return Err("transport".into()),
            }
            line = self.dial().await?;
            dialled = true;
        };
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|_| "transport")?
            .to_bytes();
        if !line.is_closed() {
            self.idle.lock().expect("idle lines").push(line);
        }
        Ok((status, body))
    }

    /// The most recently used idle connection still open; closed ones are dropped.
    fn take_open(&self) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.idle.lock().expect("idle lines");
        while let Some(line) = idle.pop() {
            if !line.is_closed() {
                return Some(line);
            }
        }
        None
    }

    async fn dial(&self) -> Result<SendRequest<Full<Bytes>>, String> {
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|_| "transport")?;
        stream.set_nodelay(true).map_err(|_| "transport")?;
        let (line, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|_| "transport")?;
        tokio::spawn(connection);
        Ok(line)
    }
}

fn all_queued(reply: Reply) -> Result<(), String> {
    fn status(outcome: &Outcome) -> &str {
        outcome.status.as_deref().unwrap_or("missing")
    }
    match reply.results.iter().find(|r| status(r) != "queued") {
        None if !reply.results.is_empty() => Ok(()),
        None => Err("no results".into()),
        Some(outcome) => Err(format!("status {}", status(outcome))),
    }
}
