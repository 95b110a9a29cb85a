//! Leader election on a lock named for the role (DESIGN.md §5): the holder is the leader, its fencing
//! token is the leader's **epoch**, and the value stored with the grant says who leads. Downstream systems
//! reject messages that carry an epoch older than the newest they have seen, exactly as a fenced resource
//! rejects old tokens.

use crate::client::Client;
use crate::error::Error;
use crate::guard::LockGuard;
use crate::session::{LeaseLost, Session};
use std::time::Duration;

/// The current leader of a role, as seen by a linearizable read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    /// The value the leader campaigned with.
    pub value: Vec<u8>,
    /// The leader's epoch (its fencing token): strictly increasing across leaders of the role.
    pub epoch: u64,
    /// The leader's session id (in the role's group).
    pub session: u64,
}

/// Leadership of a role, held until [`Leadership::resign`], the session's end, or lease loss.
pub struct Leadership {
    guard: LockGuard,
    value: Vec<u8>,
}

impl Leadership {
    /// The epoch of this leadership: send it with every message a leader sends.
    pub fn epoch(&self) -> u64 {
        self.guard.token()
    }

    pub fn value(&self) -> &[u8] {
        &self.value
    }

    pub fn role(&self) -> &str {
        self.guard.name()
    }

    /// Resolves when leadership may be lost (the session's lease may be gone): stop acting as leader.
    pub async fn lost(&self) -> LeaseLost {
        self.guard.lost().await
    }

    /// Steps down, letting the next candidate in line lead.
    pub async fn resign(self) -> Result<(), Error> {
        self.guard.release().await
    }
}

impl Session {
    /// Campaigns for `role`: waits in line (FIFO) until this session leads, then returns the leadership.
    /// `value` (at most 1,024 bytes) tells observers who leads.
    pub async fn campaign(&self, role: &str, value: &[u8]) -> Result<Leadership, Error> {
        loop {
            // The server bounds one wait at 5 minutes; a campaign waits as long as it takes.
            match self
                .acquire_with_value(role, Duration::from_secs(300), value)
                .await
            {
                Ok(guard) => {
                    return Ok(Leadership {
                        guard,
                        value: value.to_vec(),
                    })
                }
                Err(Error::LockHeld { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Client {
    /// Who leads `role` now (linearizable), if anyone.
    pub async fn leader(&self, role: &str) -> Result<Option<Leader>, Error> {
        // A role in its lock-delay (its leader's session expired) has no leader.
        Ok(self
            .describe(role)
            .await?
            .filter(|l| !l.delayed)
            .map(|l| Leader {
                value: l.holder_value,
                epoch: l.token,
                session: l.holder_session_id,
            }))
    }

    /// Follows who leads `role`.
    pub fn observe(&self, role: &str) -> Observer {
        Observer {
            client: self.clone(),
            role: role.to_string(),
            watch: None,
            now: None,
            last: None,
            first: true,
        }
    }
}

/// Reports each change of a role's leader (see [`Client::observe`]), from a watch of the role's lock:
/// every leader that held it is reported, in order, with increasing epochs. Only if the watch's position
/// is lost (the servers no longer keep its events, [`Error::Compacted`]) does the observer start over
/// from the current leader, and leaders in between are skipped.
pub struct Observer {
    client: Client,
    role: String,
    watch: Option<crate::watch::Watch>,
    /// The leader as of the events seen so far.
    now: Option<Leader>,
    /// The last one reported.
    last: Option<Leader>,
    first: bool,
}

impl Observer {
    /// Waits for the next change of leader (the current one, the first time) and returns it; `None` when
    /// the role has no leader.
    pub async fn next(&mut self) -> Result<Option<Leader>, Error> {
        loop {
            let watch = match &mut self.watch {
                Some(w) => w,
                None => {
                    // The role's leader now (linearizable), then every change after it.
                    let w = self.client.watch_lock(&self.role).await?;
                    self.now = w.current().first().filter(|l| !l.delayed).map(|l| Leader {
                        value: l.holder_value.clone(),
                        epoch: l.token,
                        session: l.holder_session_id,
                    });
                    self.watch.insert(w)
                }
            };
            if self.first || self.now != self.last {
                self.first = false;
                self.last = self.now.clone();
                return Ok(self.now.clone());
            }
            // All of one entry at once: a release and the grant to the next in line are one change.
            match watch.next_entry().await {
                Ok(events) => {
                    for e in events {
                        match e.kind {
                            crate::watch::EventKind::Granted => {
                                self.now = Some(Leader {
                                    value: e.value,
                                    epoch: e.token,
                                    session: e.session,
                                })
                            }
                            crate::watch::EventKind::Released
                            | crate::watch::EventKind::Expired
                            | crate::watch::EventKind::Delayed
                            | crate::watch::EventKind::DelayEnded => self.now = None,
                            _ => {}
                        }
                    }
                }
                // The position is gone: start over from the current leader.
                Err(Error::Compacted(_)) => self.watch = None,
                // The next call starts a new watch.
                Err(e) => {
                    self.watch = None;
                    return Err(e);
                }
            }
        }
    }
}
