//! Endpoints, leader following and retries.
//!
//! Each write goes to the server believed to lead the lock's group. A `NOT_LEADER` answer names the leader
//! and the request is sent there at once; an unreachable server, an election in progress or an unknown
//! outcome make the client try the next server after a backoff, until the request's deadline. Every attempt
//! has its own timeout, so a silent (partitioned or paused) server costs at most one attempt.

use crate::error::{classify, Disposition, Error};
use holdfast_proto::v1 as pb;
use holdfast_proto::v1::holdfast_client::HoldfastClient;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Longest a call may take, all retries included (a waiting acquire adds its wait to this).
    pub request_timeout: Duration,
    /// Longest one attempt against one server may take.
    pub attempt_timeout: Duration,
    /// TCP connect timeout per server.
    pub connect_timeout: Duration,
    /// Renew all of this client's sessions together, one message per group per round over a keepalive
    /// stream (the default). `false` makes every session send its own unary keepalives, which is what a
    /// benchmark of one-heartbeat-per-session load wants.
    pub batched_keepalives: bool,
    /// Fixes the stream of session-open nonces (deterministic tests and the simulation). None, the
    /// default: random per process. Two clients with the same seed would collide, so never share one.
    pub nonce_seed: Option<u64>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            request_timeout: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_millis(500),
            batched_keepalives: true,
            nonce_seed: None,
        }
    }
}

/// A connection to a Holdfast cluster. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) registry: crate::keepalive::Registry,
    endpoints: Vec<String>,
    channels: Vec<Channel>,
    groups: u32,
    /// The endpoint index believed to lead each group.
    leaders: Mutex<Vec<usize>>,
    options: ClientOptions,
    /// Opens so far, for [`ClientOptions::nonce_seed`].
    pub(crate) opens: std::sync::atomic::AtomicU64,
}

impl Client {
    /// Connects to a cluster given some of its servers' client endpoints (`host:port`).
    pub async fn connect<I, S>(endpoints: I) -> Result<Client, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Client::connect_with(endpoints, ClientOptions::default()).await
    }

    pub async fn connect_with<I, S>(endpoints: I, options: ClientOptions) -> Result<Client, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let endpoints: Vec<String> = endpoints.into_iter().map(Into::into).collect();
        if endpoints.is_empty() {
            return Err(Error::InvalidArgument("no endpoints given".into()));
        }
        let channels = endpoints
            .iter()
            .map(|ep| {
                Endpoint::from_shared(format!("http://{ep}"))
                    .map(|e| {
                        // Pings detect a dead connection (half-open after a network fault) in ~4 s;
                        // it is closed and the next call reconnects.
                        let e = e
                            .connect_timeout(options.connect_timeout)
                            .tcp_nodelay(true)
                            .http2_keep_alive_interval(Duration::from_secs(2))
                            .keep_alive_timeout(Duration::from_secs(2))
                            .keep_alive_while_idle(true);
                        holdfast_proto::transport::connect_lazy(e)
                    })
                    .map_err(|e| Error::InvalidArgument(format!("bad endpoint {ep:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut inner = Inner {
            registry: Default::default(),
            endpoints,
            channels,
            groups: 1,
            leaders: Mutex::new(vec![0]),
            options: options.clone(),
            opens: Default::default(),
        };
        // Learn the group count (and a first leader hint) from any server that answers.
        let deadline = Instant::now() + options.request_timeout;
        let mut last = String::new();
        'outer: loop {
            for i in 0..inner.endpoints.len() {
                let mut c = HoldfastClient::new(inner.channels[i].clone());
                match tokio::time::timeout(
                    options.attempt_timeout,
                    c.status(pb::StatusRequest::default()),
                )
                .await
                {
                    Ok(Ok(s)) => {
                        let s = s.into_inner();
                        inner.groups = s.group_count.max(1);
                        let leaders = (0..inner.groups)
                            .map(|g| {
                                s.groups
                                    .iter()
                                    .find(|gs| gs.group == g)
                                    .and_then(|gs| {
                                        inner
                                            .endpoints
                                            .iter()
                                            .position(|e| *e == gs.leader_endpoint)
                                    })
                                    .unwrap_or(i)
                            })
                            .collect();
                        inner.leaders = Mutex::new(leaders);
                        break 'outer;
                    }
                    Ok(Err(e)) => last = format!("{}: {}", inner.endpoints[i], e.message()),
                    Err(_) => last = format!("{}: no answer", inner.endpoints[i]),
                }
            }
            if Instant::now() > deadline {
                return Err(Error::Unavailable(format!("no server answered: {last}")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    /// Number of Raft groups lock names are spread over.
    pub fn groups(&self) -> u32 {
        self.inner.groups
    }

    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// Runs `f` against the group's leader, following redirects and retrying until the deadline.
    /// `extra` extends both the per-attempt and the overall timeout (for waiting acquires).
    pub(crate) async fn call<T, F, Fut>(
        &self,
        group: u32,
        extra: Duration,
        f: F,
    ) -> Result<T, Error>
    where
        F: Fn(HoldfastClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + self.inner.options.request_timeout + extra;
        self.call_until(group, deadline, extra, f).await
    }

    /// [`Client::call`] with an explicit overall deadline.
    pub(crate) async fn call_until<T, F, Fut>(
        &self,
        group: u32,
        deadline: Instant,
        extra: Duration,
        f: F,
    ) -> Result<T, Error>
    where
        F: Fn(HoldfastClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let inner = &self.inner;
        let n = inner.endpoints.len();
        let mut target = self.leader_of(group);
        let mut backoff = Duration::from_millis(20);
        let mut redirects = 0;
        loop {
            let client = HoldfastClient::new(inner.channels[target].clone());
            let limit = (inner.options.attempt_timeout + extra)
                .min(deadline.saturating_duration_since(Instant::now()));
            let attempt = tokio::time::timeout(limit, f(client)).await;
            let reason = match attempt {
                Ok(Ok(resp)) => {
                    self.set_leader(group, target);
                    return Ok(resp.into_inner());
                }
                Ok(Err(status)) => match classify(&status) {
                    Disposition::Fail(e) => return Err(e),
                    Disposition::Redirect(ep) => {
                        match inner.endpoints.iter().position(|e| *e == ep) {
                            Some(i) if redirects < 2 * n => {
                                redirects += 1;
                                target = i;
                                self.set_leader(group, i);
                                continue;
                            }
                            _ => format!("redirected to {ep}, which is not among the endpoints"),
                        }
                    }
                    Disposition::Retry(msg) => msg,
                },
                Err(_) => format!(
                    "{} did not answer within {limit:?}",
                    inner.endpoints[target]
                ),
            };
            if Instant::now() + backoff > deadline {
                return Err(Error::Unavailable(reason));
            }
            tracing::debug!(endpoint = %inner.endpoints[target], %reason, "retrying on another server");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
            target = (target + 1) % n;
            redirects = 0;
        }
    }

    pub(crate) fn from_inner(inner: Arc<Inner>) -> Client {
        Client { inner }
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    pub(crate) fn channel(&self, index: usize) -> Channel {
        self.inner.channels[index].clone()
    }

    /// The endpoint index believed to lead `group`.
    pub(crate) fn leader_of(&self, group: u32) -> usize {
        self.inner
            .leaders
            .lock()
            .expect("leader lock")
            .get(group as usize)
            .copied()
            .unwrap_or(0)
    }

    pub(crate) fn set_leader(&self, group: u32, index: usize) {
        if let Some(slot) = self
            .inner
            .leaders
            .lock()
            .expect("leader lock")
            .get_mut(group as usize)
        {
            *slot = index;
        }
    }

    /// Describes a lock (linearizable). `None` if it is free.
    pub async fn describe(&self, name: &str) -> Result<Option<pb::LockInfo>, Error> {
        let group = crate::group_for(name, self.groups());
        let name = name.to_string();
        let r = self
            .call(group, Duration::ZERO, |mut c| {
                let req = pb::DescribeRequest {
                    group,
                    name: name.clone(),
                };
                async move { c.describe(req).await }
            })
            .await?;
        Ok(r.lock)
    }

    /// Lists locks whose names start with `prefix` in every group (linearizable per group), in name order.
    pub async fn list_locks(&self, prefix: &str) -> Result<Vec<pb::LockInfo>, Error> {
        let mut all = Vec::new();
        for group in 0..self.groups() {
            let mut after = String::new();
            loop {
                let (prefix, a) = (prefix.to_string(), after.clone());
                let page = self
                    .call(group, Duration::ZERO, |mut c| {
                        let req = pb::ListLocksRequest {
                            group,
                            prefix: prefix.clone(),
                            after: a.clone(),
                            limit: 1000,
                        };
                        async move { c.list_locks(req).await }
                    })
                    .await?;
                after = page
                    .locks
                    .last()
                    .map(|l| l.name.clone())
                    .unwrap_or_default();
                all.extend(page.locks);
                if !page.more {
                    break;
                }
            }
        }
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all)
    }

    /// Lists every session of every group (linearizable per group).
    pub async fn list_sessions(&self) -> Result<Vec<(u32, pb::SessionInfo)>, Error> {
        let mut all = Vec::new();
        for group in 0..self.groups() {
            let mut after = 0;
            loop {
                let page = self
                    .call(group, Duration::ZERO, |mut c| async move {
                        c.list_sessions(pb::ListSessionsRequest {
                            group,
                            after,
                            limit: 1000,
                        })
                        .await
                    })
                    .await?;
                after = page.sessions.last().map_or(0, |s| s.session_id);
                all.extend(page.sessions.into_iter().map(|s| (group, s)));
                if !page.more {
                    break;
                }
            }
        }
        Ok(all)
    }

    /// Asks one server (by endpoint index) for its own view of the cluster. Not linearizable.
    pub async fn status_of(&self, index: usize) -> Result<pb::StatusResponse, Error> {
        let mut c = HoldfastClient::new(self.inner.channels[index].clone());
        match tokio::time::timeout(
            self.inner.options.attempt_timeout,
            c.status(pb::StatusRequest::default()),
        )
        .await
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(Error::Unavailable(format!(
                "{}: {}",
                self.inner.endpoints[index],
                s.message()
            ))),
            Err(_) => Err(Error::Unavailable(format!(
                "{}: no answer",
                self.inner.endpoints[index]
            ))),
        }
    }
}
