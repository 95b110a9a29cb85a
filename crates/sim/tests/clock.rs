//! The simulation's skewed clock (`holdfast_server::skew`), which every simulated server's openraft
//! runs on: it runs at the server's rate, and a stall stops it and then lets it jump to where it would
//! have been, with no timer on it firing early. What the seeds' clock faults rely on, checked alone.

#![cfg(holdfast_sim)]

use holdfast_server::skew::{self, SkewedInstant, SkewedRuntime};
use openraft::rt::{AsyncRuntime, Instant as _};
use std::time::Duration;

const MS: Duration = Duration::from_millis(1);

fn run(test: impl std::future::Future<Output = ()> + 'static) {
    let mut sim = turmoil::Builder::new()
        .simulation_duration(Duration::from_secs(60))
        .build();
    sim.client("host", async move {
        test.await;
        Ok(())
    });
    sim.run().expect("the clock test failed");
}

#[test]
fn a_fast_clock_runs_fast_and_its_sleeps_follow_it() {
    run(async {
        skew::set_rate(1, 20_000);
        let start = SkewedInstant::now();
        let real = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(start.elapsed(), Duration::from_millis(1_020));
        // One skewed second takes 1/1.02 of a true second, and never ends early on the skewed clock.
        let real = tokio::time::Instant::now() - real;
        let t = SkewedInstant::now();
        let before = tokio::time::Instant::now();
        SkewedRuntime::sleep(Duration::from_secs(1)).await;
        assert!(t.elapsed() >= Duration::from_secs(1));
        let slept = tokio::time::Instant::now() - before;
        assert!(
            slept < real && slept >= Duration::from_millis(980),
            "{slept:?}"
        );
    });
}

#[test]
fn a_stall_stops_the_clock_then_jumps_it_and_nothing_fires_during_it() {
    run(async {
        skew::set_rate(7, -20_000);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = SkewedInstant::now();
        assert!(skew::stall(7, Duration::from_millis(500)));
        assert!(
            !skew::stall(8, Duration::from_millis(500)),
            "node 8 has no clock"
        );
        let stalled_at = tokio::time::Instant::now();
        // A timer set during the stall (on the stopped clock: as if set just before it), and one on an
        // instant inside it, both wait it out.
        let sleep = SkewedRuntime::sleep(Duration::from_millis(100));
        let timer = SkewedRuntime::sleep_until(before + Duration::from_millis(50));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            SkewedInstant::now(),
            before,
            "the clock moved during the stall"
        );
        timer.await;
        let woke = tokio::time::Instant::now() - stalled_at;
        assert!(
            woke >= Duration::from_millis(500),
            "woke {woke:?} into a 500 ms stall"
        );
        assert!(woke <= Duration::from_millis(500) + MS, "{woke:?}");
        // Both are due once the clock jumps: it reads what it would have without the stall, 500 true
        // ms at -2%, past both of their deadlines.
        sleep.await;
        assert_eq!(tokio::time::Instant::now() - stalled_at, woke);
        let after = SkewedInstant::now() - before;
        assert!(
            after >= Duration::from_millis(489) && after <= Duration::from_millis(491),
            "{after:?}"
        );
        // The expiry loop's wait ends with the stall too.
        assert!(skew::stall(7, Duration::from_millis(200)));
        let t = tokio::time::Instant::now();
        skew::wait_unstalled().await;
        assert_eq!(tokio::time::Instant::now() - t, Duration::from_millis(200));
        skew::wait_unstalled().await;
        assert_eq!(tokio::time::Instant::now() - t, Duration::from_millis(200));
    });
}
