//! A TCP proxy per directed peer link, so tests can cut links (partitions) between real server processes.
//!
//! Server i reaches server j through the proxy for link (i, j). Blocking a link drops its open connections
//! and refuses new ones until it is unblocked: server i can no longer send requests to j (or get replies).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Link {
    blocked: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Default)]
pub struct Proxies {
    links: Mutex<HashMap<(u64, u64), Link>>,
}

impl Proxies {
    /// Starts the proxy for link `from -> to`, forwarding to `target_port`. Returns the proxy's port.
    pub async fn add(&self, from: u64, to: u64, target_port: u16) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (blocked, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, target_port, rx));
        self.links
            .lock()
            .unwrap()
            .insert((from, to), Link { blocked, task });
        port
    }

    /// Cuts every link to and from `node`.
    pub fn isolate(&self, node: u64) {
        let links = self.links.lock().unwrap();
        for ((from, to), l) in links.iter() {
            if *from == node || *to == node {
                l.blocked.send_replace(true);
            }
        }
    }

    pub fn heal(&self) {
        for l in self.links.lock().unwrap().values() {
            l.blocked.send_replace(false);
        }
    }
}

async fn accept_loop(listener: TcpListener, target_port: u16, blocked: watch::Receiver<bool>) {
    let blocked = Arc::new(blocked);
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            continue;
        };
        if *blocked.borrow() {
            drop(inbound);
            continue;
        }
        let mut rx = (*blocked).clone();
        tokio::spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target_port)).await else {
                return;
            };
            let mut inbound = inbound;
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                _ = rx.wait_for(|b| *b) => {}
            }
        });
    }
}
