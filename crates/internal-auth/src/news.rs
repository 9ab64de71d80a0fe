//! A service's news to its watchers as a gRPC server stream: auth's `WatchSessions` and the
//! registry's `WatchDevices` (a host named, a heartbeat, or news lost).

use std::pin::Pin;

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// What a watch answers its watcher.
pub type NewsStream<E> = Pin<Box<dyn futures::Stream<Item = Result<E, Status>> + Send>>;

/// What one piece of news tells a watcher.
pub enum Told<E> {
    Event(E),
    /// News may have been lost: the watcher must not trust what it kept under this stream.
    Lost,
}

/// `news` as it comes, each made an event by `tell`, until `shutdown`; ABORTED (then the end) if
/// the watcher fell behind or news was lost. `what` names the news in that status.
pub fn news_stream<N, E>(
    news: broadcast::Receiver<N>,
    shutdown: CancellationToken,
    what: &'static str,
    tell: fn(N) -> Told<E>,
) -> NewsStream<E>
where
    N: Clone + Send + 'static,
    E: Send + 'static,
{
    use broadcast::error::RecvError;
    let lost = move || Status::aborted(format!("{what} news was lost: watch again"));
    Box::pin(futures::stream::unfold(
        Some((news, shutdown)),
        move |state| async move {
            let (mut news, shutdown) = state?;
            let event = tokio::select! {
                biased;
                () = shutdown.cancelled() => return None,
                next = news.recv() => match next.map(tell) {
                    Ok(Told::Event(event)) => event,
                    Ok(Told::Lost) | Err(RecvError::Lagged(_)) => {
                        return Some((Err(lost()), None));
                    }
                    Err(RecvError::Closed) => return None,
                },
            };
            Some((Ok(event), Some((news, shutdown))))
        },
    ))
}
