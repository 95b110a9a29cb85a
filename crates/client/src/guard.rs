//! A held lock.

use crate::error::Error;
use crate::session::{LeaseLost, Session};

/// A lock held by a [`Session`], with its fencing token. Release it with [`LockGuard::release`]; dropping it
/// releases it in the background, best effort (the session's expiry or close releases it for sure).
pub struct LockGuard {
    session: Session,
    name: String,
    group: u32,
    token: u64,
    released: bool,
}

impl LockGuard {
    pub(crate) fn new(session: Session, name: String, group: u32, token: u64) -> Self {
        LockGuard {
            session,
            name,
            group,
            token,
            released: false,
        }
    }

    /// The fencing token of this grant: send it with every write to the protected resource.
    pub fn token(&self) -> u64 {
        self.token
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn group(&self) -> u32 {
        self.group
    }

    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Resolves when the session's lease may be lost; stop acting as the holder then.
    pub async fn lost(&self) -> LeaseLost {
        self.session.lost().await
    }

    /// Stops tracking the lock without releasing it: it stays held until [`Session::release`] with the
    /// returned name and token, or until the session ends. Returns (name, token).
    pub fn into_parts(mut self) -> (String, u64) {
        self.released = true;
        (std::mem::take(&mut self.name), self.token)
    }

    /// True while the session's client-side lease is valid.
    pub fn is_valid(&self) -> bool {
        self.session.is_valid()
    }

    /// Releases the lock. Fails with [`Error::StaleToken`] or [`Error::NotHolder`] if the grant ended
    /// already (the session expired and someone else may hold it now).
    pub async fn release(mut self) -> Result<(), Error> {
        self.released = true;
        self.session.release(&self.name, self.token).await
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (session, name, token) = (
                self.session.clone(),
                std::mem::take(&mut self.name),
                self.token,
            );
            handle.spawn(async move {
                if let Err(e) = session.release(&name, token).await {
                    tracing::debug!(%e, name, "background release on drop failed");
                }
            });
        }
    }
}
