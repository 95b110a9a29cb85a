//! The web dashboard (`/ui`) in a real browser: headless Chromium (the Debian package; `.ci/run` installs
//! it) loads the page from a follower of a 5-server, 2-group cluster, runs its JavaScript against the
//! server's JSON endpoints, and the DOM it ends with must show each group's leader, a lock this test took
//! and its holder and token.

use crate::harness::{Cluster, Options};
use std::time::Duration;

fn chromium() -> String {
    for candidate in ["chromium", "chromium-browser", "google-chrome"] {
        if std::process::Command::new(candidate)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return candidate.to_string();
        }
    }
    panic!("no Chromium found: apt-get install chromium (.ci/run does)");
}

/// The page's DOM once its scripts have run (up to 5 s of virtual time: the first poll is done).
async fn rendered(url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let run = tokio::process::Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--dump-dom", url])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("chromium finished within 90 s")
        .unwrap();
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_leaders_and_a_held_lock_in_a_browser() {
    let c = Cluster::start(Options {
        http: true,
        groups: 2,
        ..Options::default()
    })
    .await;
    let leaders = [
        c.wait_for_leader(0, Duration::from_secs(30)).await,
        c.wait_for_leader(1, Duration::from_secs(30)).await,
    ];
    let client = c.client().await;
    let session = client.open_session(Duration::from_secs(10)).await.unwrap();
    // A name with markup in it: the page must show it as text.
    let name = "ui/<b>report</b>";
    let guard = session.try_acquire(name).await.unwrap();
    let group = holdfast_client::group_for(name, 2);
    // From a follower of the lock's group, after it has applied the grant.
    let follower = (1..=5).find(|id| *id != leaders[group as usize]).unwrap();
    let port = c.servers[(follower - 1) as usize].http_port.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !c
        .http_get(follower, "/ui/api/locks?prefix=ui%2F")
        .await
        .1
        .contains(&format!("\"token\":{}", guard.token()))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "follower never applied the grant"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let dom = rendered(&format!("http://127.0.0.1:{port}/ui")).await;
    for (g, leader) in leaders.iter().enumerate() {
        let shown = format!("id=\"leader-{g}\">node {leader}<");
        assert!(dom.contains(&shown), "no {shown:?} in the page:\n{dom}");
    }
    let escaped = "ui/&lt;b&gt;report&lt;/b&gt;";
    // The row whose first cell is the name, as text (matched on the cell, not on the row's data
    // attribute, whose escaping differs between Chromium versions).
    let row = dom
        .split("<tr ")
        .find(|r| r.contains(&format!("><td>{escaped}</td>")))
        .unwrap_or_else(|| panic!("no row for the lock in the page:\n{dom}"));
    let holder = format!("<td class=\"num holder\">{}</td>", session.id_for(name));
    let token = format!("<td class=\"num\">{}</td>", guard.token());
    assert!(row.contains(&holder) && row.contains(&token), "{row}");
    assert!(
        !dom.contains("<b>report</b>"),
        "a lock name was put in the page as HTML"
    );
    assert!(
        dom.contains(&format!("this server: node <b id=\"node\">{follower}</b>")),
        "{dom}"
    );
    guard.release().await.unwrap();

    // The lists page by name (two groups merged), and a malformed query is refused, not read as "all".
    let _more = [
        session.try_acquire("ui/page-1").await.unwrap(),
        session.try_acquire("ui/page-2").await.unwrap(),
    ];
    let page = |after: &'static str| {
        let c = &c;
        async move {
            let path = format!("/ui/api/locks?prefix=ui%2Fpage&limit=1&after={after}");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let body = c.http_get(follower, &path).await.1;
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                let names: Vec<String> = v["locks"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|l| l["name"].as_str().unwrap().to_string())
                    .collect();
                // Wait out a follower that has not applied both grants yet.
                if v["more"] == true
                    || names == ["ui/page-2"]
                    || tokio::time::Instant::now() > deadline
                {
                    return (names, v["more"].clone());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(
        page("").await,
        (vec!["ui/page-1".to_string()], serde_json::json!(true))
    );
    assert_eq!(
        page("ui%2Fpage-1").await,
        (vec!["ui/page-2".to_string()], serde_json::json!(false))
    );
    for bad in [
        "/ui/api/locks?prefix=%zz",
        "/ui/api/locks?limit=x",
        "/ui/api/sessions?after=-1",
    ] {
        let (code, body) = c.http_get(follower, bad).await;
        assert_eq!(code, 400, "{bad}: {body}");
    }
    let (code, _) = c.http_get(follower, "/nothing-here").await;
    assert_eq!(code, 404);
}
