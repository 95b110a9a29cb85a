//! Hold a lock around a piece of work, and stop working if the lease may be lost.
//!
//! Run against the dev cluster (`holdfast dev`): `cargo run -p holdfast-client --example lock_around_work`

use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), holdfast_client::Error> {
    let endpoints = std::env::var("HOLDFAST_ENDPOINTS")
        .unwrap_or_else(|_| "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003".into());
    let client = holdfast_client::Client::connect(endpoints.split(',').map(str::to_string)).await?;
    let session = client.open_session(Duration::from_secs(10)).await?;
    let guard = session
        .acquire_timeout("examples/report", Duration::from_secs(30))
        .await?;
    println!(
        "holding examples/report with fencing token {}",
        guard.token()
    );

    tokio::select! {
        _ = do_the_work(guard.token()) => println!("work done"),
        lost = guard.lost() => {
            // Someone else may hold the lock now: stop at once. Anything written with our token from now
            // on will be refused by a fenced resource anyway.
            println!("lease lost ({}), abandoning the work", lost.0);
            return Ok(());
        }
    }
    guard.release().await?;
    session.close().await
}

async fn do_the_work(token: u64) {
    for step in 1..=3 {
        println!("step {step} (writes carry token {token})");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
