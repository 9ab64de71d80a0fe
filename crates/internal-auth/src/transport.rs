//! Where an internal call goes: over HTTP/2 to a server elsewhere, or (all in one) straight into a
//! server in this process, called as a tower service. Both run the same protos and the same server
//! layers: trace context, the caller's deadline, status codes and the caller check. An in-process
//! call carries no token: it carries a [`LocalCaller`] request extension instead, which only code
//! in this process can attach (extensions never cross a socket).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tower::util::BoxCloneSyncService;

use crate::{InternalKey, RequireToken, RunToCompletion};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
type Body = tonic::body::Body;

/// The longest any internal call may take, as the network channels' own timeout.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(40);

/// How a service is reached.
#[derive(Clone)]
pub enum Target {
    /// `http://host:port` (several comma-separated for replicas).
    Url(String),
    /// A server in this process.
    Local(LocalServer),
}

impl From<String> for Target {
    fn from(url: String) -> Self {
        Self::Url(url)
    }
}

impl From<&str> for Target {
    fn from(url: &str) -> Self {
        Self::Url(url.to_owned())
    }
}

/// A service's gRPC routes behind the layers its network server runs, callable in this process.
#[derive(Clone)]
pub struct LocalServer(BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>);

impl LocalServer {
    /// `routes` (health, reflection and the service) as `audience`'s network server would serve
    /// them: the caller's deadline, a server span, the caller check, each call run to completion
    /// (but those of [`crate::ENDS_WITH_CALLER`]).
    pub fn new(key: InternalKey, audience: &'static str, routes: tonic::service::Routes) -> Self {
        Self::checked_by(RequireToken::new(key, audience), routes)
    }

    /// `routes` behind `check` instead of one audience's.
    pub fn checked_by(check: RequireToken, routes: tonic::service::Routes) -> Self {
        let service = tower::ServiceBuilder::new()
            .layer(DeadlineLayer)
            .layer(orca_push_telemetry::GrpcServerLayer::new(
                orca_push_proto::is_known_method,
            ))
            .layer(check)
            .layer(RunToCompletion)
            .service(routes.prepare());
        Self(BoxCloneSyncService::new(service))
    }

    /// Serves one request (the all-in-one listener's dispatch).
    pub(crate) fn serve(
        &self,
        request: http::Request<Body>,
    ) -> impl Future<Output = http::Response<Body>> + Send + 'static {
        use tower::ServiceExt as _;
        let call = self.0.clone().oneshot(request);
        async move {
            match call.await {
                Ok(response) => response,
                Err(never) => match never {},
            }
        }
    }
}

/// Proof that a call was made in this process by `subject`. It has no public constructor and
/// never crosses a socket, so nothing outside the process can present it.
#[derive(Debug, Clone)]
pub struct LocalCaller {
    pub(crate) subject: std::sync::Arc<str>,
}

/// A tonic channel, or a server in this process.
#[derive(Clone)]
pub enum Transport {
    Remote(tonic::transport::Channel),
    Local(LocalServer),
}

impl tower::Service<http::Request<Body>> for Transport {
    type Response = http::Response<Body>;
    type Error = tower::BoxError;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self {
            Self::Remote(channel) => channel.poll_ready(cx).map_err(Into::into),
            Self::Local(server) => server.0.poll_ready(cx).map_err(|never| match never {}),
        }
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        match self {
            Self::Remote(channel) => {
                let call = channel.call(request);
                Box::pin(async move { call.await.map_err(Into::into) })
            }
            Self::Local(server) => {
                let call = server.0.call(request);
                Box::pin(async move { call.await.map_err(|never| match never {}) })
            }
        }
    }
}

/// Server side of an in-process call: the caller's `grpc-timeout` (at most [`CALL_TIMEOUT`]), as
/// tonic's network server applies it, answering CANCELLED "Timeout expired" when it runs out.
#[derive(Debug, Clone, Copy)]
struct DeadlineLayer;

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Deadline { inner }
    }
}

#[derive(Debug, Clone)]
struct Deadline<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for Deadline<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let limit = request
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .map_or(CALL_TIMEOUT, |asked| asked.min(CALL_TIMEOUT));
        let call = self.inner.call(request);
        Box::pin(async move {
            match tokio::time::timeout(limit, call).await {
                Ok(result) => result,
                Err(_) => Ok(tonic::Status::cancelled("Timeout expired").into_http()),
            }
        })
    }
}

/// A `grpc-timeout` header value: at most eight digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_as_the_protocol_writes_them() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "S", "5", "5s", "-5S", "123456789S", "5 S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    /// A server that answers after `delay`, behind the in-process deadline.
    async fn answer_after(delay: Duration, grpc_timeout: Option<&str>) -> tonic::Code {
        use tower::{Layer as _, ServiceExt as _};
        let slow = tower::service_fn(move |_: http::Request<()>| async move {
            tokio::time::sleep(delay).await;
            Ok::<_, Infallible>(http::Response::new(Body::empty()))
        });
        let mut request = http::Request::builder().uri("/orca.push.queue.v1.QueueService/Enqueue");
        if let Some(timeout) = grpc_timeout {
            request = request.header("grpc-timeout", timeout);
        }
        let response = DeadlineLayer
            .layer(slow)
            .oneshot(request.body(()).unwrap())
            .await
            .unwrap();
        tonic::Status::from_header_map(response.headers()).map_or(tonic::Code::Ok, |s| s.code())
    }

    #[tokio::test(start_paused = true)]
    async fn an_in_process_call_ends_at_its_callers_deadline_and_never_after_the_channels() {
        assert_eq!(
            answer_after(Duration::from_millis(10), Some("50m")).await,
            tonic::Code::Ok
        );
        assert_eq!(
            answer_after(Duration::from_millis(100), Some("50m")).await,
            tonic::Code::Cancelled
        );
        // No deadline asked, or a longer one: the network channels' own timeout still holds.
        assert_eq!(
            answer_after(CALL_TIMEOUT + Duration::from_secs(1), None).await,
            tonic::Code::Cancelled
        );
        assert_eq!(
            answer_after(CALL_TIMEOUT + Duration::from_secs(1), Some("1H")).await,
            tonic::Code::Cancelled
        );
        assert_eq!(
            answer_after(CALL_TIMEOUT - Duration::from_secs(1), None).await,
            tonic::Code::Ok
        );
    }
}
