//! Watches: follow what happens to the locks under a name prefix, as a stream of events in log order.
//!
//! A [`Watch`] holds one server stream per group (names are spread over groups by hash, and each group
//! has its own log). Each stream is owned by a task that reconnects, on the group's leader, from exactly
//! where it stopped (`start_index` and `skip_events`), for as long as the `Watch` lives: a leader change
//! or a restarted server costs a gap in time, never a missing or repeated event. Only a position the
//! servers no longer keep ends a watch, with [`Error::Compacted`].
//!
//! Events of one group are in log order; events of different groups are not ordered with each other
//! (the groups' logs are independent).

use crate::client::Client;
use crate::error::{classify, Disposition, Error};
use holdfast_proto::v1 as pb;
use std::collections::VecDeque;
use std::time::Duration;

/// Largest watch message this client accepts: 2,000 events with 256-byte names and 1 KiB values.
const MAX_WATCH_MESSAGE_BYTES: usize = 16 << 20;
/// Messages buffered between a group's stream task and [`Watch::next`]. A caller that stops reading
/// makes the task stop reading too; the server then cuts the stream off when the caller is too far
/// behind (and the watch ends with [`Error::Compacted`]).
const BUFFER: usize = 16;
/// A server sends at least one message a second on a live stream; a stream silent for this long is
/// given up and resumed on the leader (a server cut off from the others may not notice at once).
const SILENCE: Duration = Duration::from_secs(5);

/// What happened to a lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Granted, at once or to the first waiter after its holder left.
    Granted,
    /// The holder released it, closed its session, or abandoned the acquire that got it.
    Released,
    /// The holder's session expired.
    Expired,
    /// A session started waiting for it.
    Queued,
    /// A waiter left the queue without it: cancelled, abandoned, or its session ended.
    Cancelled,
    /// Follows `Expired` when the expired grant had a lock-delay: nobody holds it or is granted it
    /// until `DelayEnded` (session 0; token: the expired grant's).
    Delayed,
    /// The lock-delay ended: the lock is free, or a `Granted` of the same index follows.
    DelayEnded,
    /// A kind this client does not know (a newer server): the protobuf number.
    Unknown(i32),
}

/// One change of one lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    pub group: u32,
    /// The log index (in `group`) of the entry that made the change; several events may share it.
    pub index: u64,
    pub kind: EventKind,
    pub name: String,
    /// The holder (granted, released, expired) or the waiter (queued, cancelled).
    pub session: u64,
    /// The grant's fencing token; 0 for queued and cancelled.
    pub token: u64,
    /// Granted: the value the acquire carried (a leader election's leader value).
    pub value: Vec<u8>,
}

/// Where a watch is in each group's log: the next event to deliver is at `index`, after the first `skip`
/// of that index's events under the watch's prefix. Pass it to [`Client::watch_from`] with the same
/// prefix to resume without a gap or a repeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Position {
    /// The prefix watched (`skip` counts its events only).
    pub prefix: String,
    /// One (index, skip) per group, by group.
    pub groups: Vec<(u64, u32)>,
}

/// A running watch (see the module docs). Dropping it stops its streams.
pub struct Watch {
    rx: tokio::sync::mpsc::Receiver<(u32, Result<pb::WatchResponse, Error>)>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pending: VecDeque<Pending>,
    prefix: String,
    /// What the caller has been given, per group.
    position: Vec<(u64, u32)>,
    current: Vec<pb::LockInfo>,
    failed: Option<Error>,
}

enum Pending {
    Event(WatchEvent),
    /// Every event of the group up to this index has been delivered.
    Through(u32, u64),
}

impl Drop for Watch {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// What to ask each group's leader for.
#[derive(Clone)]
struct Spec {
    prefix: String,
    exact: bool,
    include_current: bool,
}

impl Client {
    /// Watches every lock whose name starts with `prefix` (all locks if empty), from now: every change
    /// after this returns is delivered.
    pub async fn watch(&self, prefix: &str) -> Result<Watch, Error> {
        let spec = Spec {
            prefix: prefix.to_string(),
            exact: false,
            include_current: false,
        };
        let start = vec![(0, 0); self.groups() as usize];
        self.start_watch(spec, start).await
    }

    /// Resumes a watch from `position` (from [`Watch::position`]): the events after the last one it
    /// delivered, none twice. [`Error::Compacted`] if the leaders no longer keep them.
    pub async fn watch_from(&self, position: &Position) -> Result<Watch, Error> {
        let prefix = position.prefix.as_str();
        if position.groups.len() != self.groups() as usize {
            return Err(Error::InvalidArgument(format!(
                "the position has {} groups, the cluster {}",
                position.groups.len(),
                self.groups()
            )));
        }
        let spec = Spec {
            prefix: prefix.to_string(),
            exact: false,
            include_current: false,
        };
        self.start_watch(spec, position.groups.clone()).await
    }

    /// Watches one lock from now, with its current state ([`Watch::current`]).
    pub(crate) async fn watch_lock(&self, name: &str) -> Result<Watch, Error> {
        let spec = Spec {
            prefix: name.to_string(),
            exact: true,
            include_current: true,
        };
        let group = crate::group_for(name, self.groups());
        let mut start = vec![(u64::MAX, 0); self.groups() as usize];
        start[group as usize] = (0, 0);
        self.start_watch(spec, start).await
    }

    /// Opens one stream per group (skipping groups whose start is `u64::MAX`) and waits for each to
    /// start, so that "now" is fixed when this returns.
    async fn start_watch(&self, spec: Spec, start: Vec<(u64, u32)>) -> Result<Watch, Error> {
        let (tx, rx) = tokio::sync::mpsc::channel(BUFFER);
        // Built first, so that an error below drops it and its Drop stops the streams already open.
        let mut watch = Watch {
            rx,
            tasks: Vec::new(),
            pending: VecDeque::new(),
            prefix: spec.prefix.clone(),
            position: start.clone(),
            current: Vec::new(),
            failed: None,
        };
        for (group, &(index, skip)) in start.iter().enumerate() {
            if index == u64::MAX {
                continue;
            }
            let group = group as u32;
            let (stream, first) = self.open_stream(group, &spec, index, skip).await?;
            watch.current.extend(first.current);
            let through = first.through_index;
            watch.position[group as usize] = if index == 0 {
                (through + 1, 0)
            } else {
                (index, skip)
            };
            let cursor = watch.position[group as usize];
            let client = self.clone();
            let (spec, tx) = (spec.clone(), tx.clone());
            watch.tasks.push(tokio::spawn(async move {
                follow(client, group, spec, stream, cursor, tx).await;
            }));
        }
        Ok(watch)
    }

    /// Opens a group's stream on its leader and reads the first message.
    async fn open_stream(
        &self,
        group: u32,
        spec: &Spec,
        start_index: u64,
        skip_events: u32,
    ) -> Result<(tonic::Streaming<pb::WatchResponse>, pb::WatchResponse), Error> {
        let req = pb::WatchRequest {
            group,
            prefix: spec.prefix.clone(),
            exact: spec.exact,
            start_index,
            skip_events,
            include_current: spec.include_current && start_index == 0,
        };
        self.call(group, Duration::ZERO, |c| {
            let req = req.clone();
            async move {
                let mut c = c.max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES);
                let mut stream = c.watch(req).await?.into_inner();
                // The first message says where the stream starts; without it the stream is not open.
                match stream.message().await? {
                    Some(first) => Ok(tonic::Response::new((stream, first))),
                    None => Err(tonic::Status::unavailable("the watch stream ended at once")),
                }
            }
        })
        .await
    }
}

/// Reads a group's stream into `tx`, reconnecting from where it stopped until the watch is dropped or
/// fails for good.
async fn follow(
    client: Client,
    group: u32,
    spec: Spec,
    mut stream: tonic::Streaming<pb::WatchResponse>,
    mut cursor: (u64, u32),
    tx: tokio::sync::mpsc::Sender<(u32, Result<pb::WatchResponse, Error>)>,
) {
    loop {
        let status = loop {
            let message = match tokio::time::timeout(SILENCE, stream.message()).await {
                Ok(m) => m,
                Err(_) => break tonic::Status::unavailable(format!("no message for {SILENCE:?}")),
            };
            match message {
                Ok(Some(message)) => {
                    for e in &message.events {
                        cursor = if e.index == cursor.0 {
                            (cursor.0, cursor.1 + 1)
                        } else {
                            (e.index, 1)
                        };
                    }
                    if message.through_index >= cursor.0 {
                        cursor = (message.through_index + 1, 0);
                    }
                    if tx.send((group, Ok(message))).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break tonic::Status::unavailable("the watch stream ended"),
                Err(status) => break status,
            }
        };
        match classify(&status) {
            Disposition::Fail(e) => {
                let _ = tx.send((group, Err(e))).await;
                return;
            }
            Disposition::Redirect(_) | Disposition::Retry(_) => {
                tracing::debug!(group, %status, "watch stream ended; resuming");
            }
        }
        // Resume on the leader (`call` follows redirects), for as long as it takes.
        loop {
            match client.open_stream(group, &spec, cursor.0, cursor.1).await {
                Ok((s, _first)) => {
                    stream = s;
                    break;
                }
                // No leader reachable yet, or the leader has no watch slot free for now (slots are
                // per server, and a failover moves streams onto fewer servers).
                Err(e @ (Error::Unavailable(_) | Error::LimitExceeded { .. })) => {
                    tracing::debug!(group, %e, "cannot resume the watch yet");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => {
                    let _ = tx.send((group, Err(e))).await;
                    return;
                }
            }
            if tx.is_closed() {
                return;
            }
        }
    }
}

impl Watch {
    /// The next event, waiting for one. After an error the watch is over (every later call returns it).
    pub async fn next(&mut self) -> Result<WatchEvent, Error> {
        loop {
            match self.pending.pop_front() {
                Some(Pending::Event(e)) => {
                    let p = &mut self.position[e.group as usize];
                    *p = if p.0 == e.index {
                        (p.0, p.1 + 1)
                    } else {
                        (e.index, 1)
                    };
                    return Ok(e);
                }
                Some(Pending::Through(group, through)) => {
                    let p = &mut self.position[group as usize];
                    if through >= p.0 {
                        *p = (through + 1, 0);
                    }
                    continue;
                }
                None => {}
            }
            if let Some(e) = &self.failed {
                return Err(e.clone());
            }
            match self.rx.recv().await {
                Some((group, Ok(message))) => {
                    for e in message.events {
                        self.pending.push_back(Pending::Event(event(group, e)));
                    }
                    self.pending
                        .push_back(Pending::Through(group, message.through_index));
                }
                Some((_, Err(e))) => self.failed = Some(e),
                None => self.failed = Some(Error::Other("the watch's streams ended".into())),
            }
        }
    }

    /// The next event and every other event of the same log entry that has arrived with it (an entry
    /// that releases a lock and grants it to the next waiter gives both at once).
    pub(crate) async fn next_entry(&mut self) -> Result<Vec<WatchEvent>, Error> {
        let first = self.next().await?;
        let mut entry = vec![first];
        while let Some(Pending::Event(e)) = self.pending.front() {
            if e.group != entry[0].group || e.index != entry[0].index {
                break;
            }
            entry.push(self.next().await?);
        }
        Ok(entry)
    }

    /// Where this watch is: resume from here with [`Client::watch_from`]. It moves with every event
    /// [`Watch::next`] returns, and with the servers' progress messages while `next` waits.
    pub fn position(&self) -> Position {
        Position {
            prefix: self.prefix.clone(),
            groups: self.position.clone(),
        }
    }

    /// The locks as they were when the watch started (only for a watch of one lock).
    pub(crate) fn current(&self) -> &[pb::LockInfo] {
        &self.current
    }
}

fn event(group: u32, e: pb::WatchEvent) -> WatchEvent {
    let kind = match pb::WatchEventKind::try_from(e.kind) {
        Ok(pb::WatchEventKind::Granted) => EventKind::Granted,
        Ok(pb::WatchEventKind::Released) => EventKind::Released,
        Ok(pb::WatchEventKind::Expired) => EventKind::Expired,
        Ok(pb::WatchEventKind::Queued) => EventKind::Queued,
        Ok(pb::WatchEventKind::Cancelled) => EventKind::Cancelled,
        Ok(pb::WatchEventKind::Delayed) => EventKind::Delayed,
        Ok(pb::WatchEventKind::DelayEnded) => EventKind::DelayEnded,
        _ => EventKind::Unknown(e.kind),
    };
    WatchEvent {
        group,
        index: e.index,
        kind,
        name: e.name,
        session: e.session_id,
        token: e.token,
        value: e.value,
    }
}
