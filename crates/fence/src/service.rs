//! The reference fenced store over gRPC (`holdfast.v1.FencedStore`), and a client for it.

use crate::store::FencedStore;
use crate::FenceError;
use holdfast_proto::v1 as pb;
use holdfast_proto::v1::fenced_store_client::FencedStoreClient;
use holdfast_proto::v1::fenced_store_server::{FencedStore as FencedStoreApi, FencedStoreServer};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct Service {
    store: Arc<FencedStore>,
}

fn status(e: FenceError) -> Status {
    match e {
        FenceError::Stale { .. } => Status::failed_precondition(e.to_string()),
        FenceError::Invalid(_) => Status::invalid_argument(e.to_string()),
        other => Status::unavailable(other.to_string()),
    }
}

/// File work off the async threads; inline in the simulation (a thread would run outside simulated time).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Status> {
    #[cfg(holdfast_sim)]
    return Ok(f());
    #[cfg(not(holdfast_sim))]
    return tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()));
}

#[tonic::async_trait]
impl FencedStoreApi for Service {
    async fn write(
        &self,
        r: Request<pb::FencedWriteRequest>,
    ) -> Result<Response<pb::FencedWriteResponse>, Status> {
        let r = r.into_inner();
        let store = self.store.clone();
        let mark = blocking(move || store.write(&r.key, r.token, &r.value))
            .await?
            .map_err(status)?;
        Ok(Response::new(pb::FencedWriteResponse { mark }))
    }

    async fn read(
        &self,
        r: Request<pb::FencedReadRequest>,
    ) -> Result<Response<pb::FencedReadResponse>, Status> {
        let r = r.into_inner();
        let store = self.store.clone();
        let e = blocking(move || {
            if r.shared {
                store.read_shared(&r.key, r.token)
            } else {
                store.read(&r.key, r.token)
            }
        })
        .await?
        .map_err(status)?;
        Ok(Response::new(pb::FencedReadResponse {
            found: e.value.is_some(),
            value: e.value.unwrap_or_default(),
            value_token: e.value_token,
            mark: e.mark,
        }))
    }
}

/// Serves `store` on `listener` until `shutdown` resolves.
#[cfg(not(holdfast_sim))]
pub async fn serve(
    listener: tokio::net::TcpListener,
    store: Arc<FencedStore>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_listener(listener.into(), store, shutdown).await
}

/// Serves `store` on `listener` (real or simulated, see `holdfast_proto::transport`) until `shutdown`
/// resolves.
pub async fn serve_listener(
    listener: holdfast_proto::transport::Listener,
    store: Arc<FencedStore>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(FencedStoreServer::new(Service { store }))
        .serve_with_incoming_shutdown(listener.incoming(), shutdown)
        .await
}

/// A client of the reference fenced store.
#[derive(Clone)]
pub struct FenceClient {
    inner: FencedStoreClient<tonic::transport::Channel>,
}

impl FenceClient {
    /// Connects to a fenced store at `host:port`.
    pub async fn connect(endpoint: &str) -> Result<FenceClient, FenceError> {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
            .map_err(|e| FenceError::Invalid(e.to_string()))?
            .timeout(std::time::Duration::from_secs(5))
            .http2_keep_alive_interval(std::time::Duration::from_secs(2))
            .keep_alive_timeout(std::time::Duration::from_secs(2))
            .keep_alive_while_idle(true);
        let channel = holdfast_proto::transport::connect(endpoint)
            .await
            .map_err(|e| FenceError::Unavailable(e.to_string()))?;
        Ok(FenceClient {
            inner: FencedStoreClient::new(channel),
        })
    }

    /// Writes `value` under `key` with `token`; [`FenceError::Stale`] if the store has seen a higher token.
    pub async fn write(&mut self, key: &str, token: u64, value: &[u8]) -> Result<u64, FenceError> {
        let req = pb::FencedWriteRequest {
            key: key.into(),
            token,
            value: value.to_vec(),
        };
        match self.inner.write(req).await {
            Ok(r) => Ok(r.into_inner().mark),
            Err(s) => Err(from_status(key, token, s)),
        }
    }

    /// Reads `key` with `token`, raising the key's mark; returns the value and the token that wrote it.
    pub async fn read(
        &mut self,
        key: &str,
        token: u64,
    ) -> Result<Option<(Vec<u8>, u64)>, FenceError> {
        self.read_as(key, token, false).await
    }

    /// [`FenceClient::read`] for a shared lock's reader ([`crate::store::FencedStore::read_shared`]).
    pub async fn read_shared(
        &mut self,
        key: &str,
        token: u64,
    ) -> Result<Option<(Vec<u8>, u64)>, FenceError> {
        self.read_as(key, token, true).await
    }

    async fn read_as(
        &mut self,
        key: &str,
        token: u64,
        shared: bool,
    ) -> Result<Option<(Vec<u8>, u64)>, FenceError> {
        match self
            .inner
            .read(pb::FencedReadRequest {
                key: key.into(),
                token,
                shared,
            })
            .await
        {
            Ok(r) => {
                let r = r.into_inner();
                Ok(r.found.then_some((r.value, r.value_token)))
            }
            Err(s) => Err(from_status(key, token, s)),
        }
    }
}

fn from_status(key: &str, token: u64, s: Status) -> FenceError {
    match s.code() {
        tonic::Code::FailedPrecondition => {
            let seen = s
                .message()
                .rsplit(' ')
                .next()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            FenceError::Stale {
                resource: key.into(),
                token,
                seen,
            }
        }
        tonic::Code::InvalidArgument => FenceError::Invalid(s.message().into()),
        _ => FenceError::Unavailable(s.message().into()),
    }
}
