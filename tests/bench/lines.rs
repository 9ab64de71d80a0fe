//! The load generator's `POST /v1/send`: plain HTTP/1 connections to the gateway, kept open and
//! reused one request at a time, each request carrying its host's bearer and client address, as
//! wrk's would. The load generator shares the machine's two cores with the gateway it measures,
//! so what it spends per send is taken from the gateway: through the host SDK's client (reqwest
//! with its pool, timer and URL handling, the reply parsed into a JSON tree) it took 40-44% of a
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

/// As long as the host SDK's client waits for an answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(20);

/// Idle connections to one gateway, reused last in, first out: a closed loop of N workers keeps N
/// connections open, and an open loop as many as it has requests in flight.
pub struct Lines {
    /// `host:port`, dialled and sent as `Host`.
    authority: String,
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
}

/// What the gateway answers a send with, as far as the load generator reads it.
#[derive(Deserialize)]
struct Reply {
    results: Vec<Outcome>,
}

#[derive(Deserialize)]
struct Outcome {
    status: String,
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
        let body = Bytes::from(serde_json::to_vec(body).map_err(|e| e.to_string())?);
        let (status, reply) = self.post(host, body.clone()).await?;
        if status == 401 {
            let reply = host
                .client
                .call(
                    reqwest::Method::POST,
                    "/v1/send",
                    Some(&serde_json::from_slice(&body).map_err(|e| e.to_string())?),
                )
                .await
                .map_err(|e| crate::scenarios::error_kind(&e))?;
            host.renewed().await;
            return all_queued(serde_json::from_value(reply).map_err(|_| "malformed reply")?);
        }
        if status != 200 {
            let code = serde_json::from_slice::<Refusal>(&reply)
                .map_or_else(|_| "unknown".to_owned(), |r| r.error);
            return Err(format!("{status} {code}"));
        }
        all_queued(serde_json::from_slice(&reply).map_err(|_| "malformed reply")?)
    }

    /// One request on an idle connection (or a new one); the connection goes back to the idle
    /// ones unless it failed.
    async fn post(&self, host: &Host, body: Bytes) -> Result<(u16, Bytes), String> {
        let idle = self.idle.lock().expect("idle lines").pop();
        let mut line = match idle {
            Some(line) => line,
            None => self.dial().await?,
        };
        let request = hyper::Request::post("/v1/send")
            .header(HOST, &self.authority)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(AUTHORIZATION, host.bearer())
            .header("x-forwarded-for", host.forwarded.clone())
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let answered = tokio::time::timeout(ANSWER_WITHIN, async {
            line.ready().await?;
            let response = line.send_request(request).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, hyper::Error>((status, body))
        })
        .await;
        match answered {
            Ok(Ok(answer)) => {
                self.idle.lock().expect("idle lines").push(line);
                Ok(answer)
            }
            Ok(Err(_)) => Err("transport".into()),
            Err(_) => Err("timeout".into()),
        }
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
    match reply.results.iter().find(|r| r.status != "queued") {
        None if !reply.results.is_empty() => Ok(()),
        None => Err("no results".into()),
        Some(outcome) => Err(format!("status {}", outcome.status)),
    }
}
