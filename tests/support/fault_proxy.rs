//! A TCP proxy in front of a provider mock that can fail the way networks do: refuse connections
//! (nothing listens on its port), stall them (accept, read the TLS ClientHello, never answer), or
//! pass them through. The gateway keeps the mock's CA and keys, so when the fault ends the very
//! same URL works again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Nothing listens: every connect is refused.
    Refuse,
    /// Connections are accepted and held: bytes are read, nothing is ever written back.
    Stall,
    /// Connections are forwarded to the mock.
    Pass,
}

/// A connection held by [`Fault::Stall`]: when it was accepted and when its client gave up.
#[derive(Debug, Clone, Copy)]
pub struct Stalled {
    pub accepted: Instant,
    pub closed_by_client: Option<Instant>,
}

pub struct FaultProxy {
    pub port: u16,
    upstream: u16,
    mode: watch::Sender<Fault>,
    listener: Mutex<Option<tokio::task::JoinHandle<()>>>,
    stalled: Arc<Mutex<Vec<Stalled>>>,
}

impl FaultProxy {
    /// A proxy on a port of its own, forwarding to `upstream` on 127.0.0.1, starting in `mode`.
    pub async fn start(upstream: u16, mode: Fault) -> Self {
        // Below the ephemeral range: while refusing, the port must stay free to listen on again.
        let port = crate::free_port();
        let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        let proxy = Self {
            port,
            upstream,
            mode: watch::Sender::new(mode),
            listener: Mutex::new(None),
            stalled: Arc::new(Mutex::new(Vec::new())),
        };
        if mode == Fault::Refuse {
            drop(listener);
        } else {
            proxy.serve(listener);
        }
        proxy
    }

    /// `url` with its port replaced by the proxy's (`https://localhost:1234` -> this port).
    pub fn url_for(&self, url: &str) -> String {
        let (base, _) = url.rsplit_once(':').expect("a URL with a port");
        format!("{base}:{}", self.port)
    }

    /// Switches the fault. Leaving [`Fault::Refuse`] listens on the same port again; entering it
    /// closes the listener. Connections already stalled are forwarded once the mode is `Pass`.
    pub async fn set(&self, mode: Fault) {
        let before = self.mode.send_replace(mode);
        if before == mode {
            return;
        }
        if mode == Fault::Refuse {
            let task = self.listener.lock().unwrap().take();
            if let Some(task) = task {
                task.abort();
                let _ = task.await;
            }
        } else if before == Fault::Refuse {
            let listener = TcpListener::bind(("127.0.0.1", self.port))
                .await
                .expect("the proxy's port again");
            self.serve(listener);
        }
    }

    /// Every connection that was stalled so far.
    pub fn stalled(&self) -> Vec<Stalled> {
        self.stalled.lock().unwrap().clone()
    }

    fn serve(&self, listener: TcpListener) {
        let mode = self.mode.subscribe();
        let upstream = self.upstream;
        let stalled = self.stalled.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(handle(client, upstream, mode.clone(), stalled.clone()));
            }
        });
        *self.listener.lock().unwrap() = Some(task);
    }
}

async fn handle(
    mut client: TcpStream,
    upstream: u16,
    mut mode: watch::Receiver<Fault>,
    stalled: Arc<Mutex<Vec<Stalled>>>,
) {
    if *mode.borrow_and_update() == Fault::Stall {
        let index = {
            let mut all = stalled.lock().unwrap();
            all.push(Stalled {
                accepted: Instant::now(),
                closed_by_client: None,
            });
            all.len() - 1
        };
        // The ClientHello (and whatever follows) is read and never answered: the handshake waits
        // until the client gives up (EOF) or the stall ends.
        let mut sink = vec![0u8; 4096];
        let mut buffered = Vec::new();
        loop {
            tokio::select! {
                read = client.read(&mut sink) => match read {
                    Ok(0) | Err(_) => {
                        stalled.lock().unwrap()[index].closed_by_client = Some(Instant::now());
                        return;
                    }
                    Ok(n) => buffered.extend_from_slice(&sink[..n]),
                },
                changed = mode.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    if *mode.borrow() == Fault::Pass {
                        break;
                    }
                }
            }
        }
        let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
            return;
        };
        if tokio::io::AsyncWriteExt::write_all(&mut server, &buffered)
            .await
            .is_err()
        {
            return;
        }
        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        return;
    }
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}

/// How long a stalled connection was held before its client gave up.
pub fn held_for(stalled: &Stalled) -> Option<Duration> {
    stalled.closed_by_client.map(|at| at - stalled.accepted)
}
