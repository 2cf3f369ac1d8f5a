//! The standby's relay against servers of the tests' own: what is passed on, to whom, and when it is cut.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use super::*;

#[test]
fn a_leader_is_reached_at_its_address_and_its_public_names() {
    let a: SocketAddr = "127.0.0.2:8070".parse().unwrap();
    assert_eq!(
        leader_urls(a, &["ci.example.org".into(), "lb.example.org:443".into()], Some("host-a")),
        ["http://127.0.0.2:8070", "http://ci.example.org:8070", "http://lb.example.org:443"]
    );
    let any: SocketAddr = "0.0.0.0:8070".parse().unwrap();
    assert_eq!(leader_urls(any, &[], Some("host-a\n")), ["http://host-a:8070"]);
    assert!(leader_urls(any, &[], None).is_empty());
    let v6: SocketAddr = "[::1]:9000".parse().unwrap();
    assert_eq!(leader_urls(v6, &["[fd00::1]:9001".into()], None), ["http://[::1]:9000", "http://[fd00::1]:9001"]);
}

use gpuci_core::coordinator_identity::SigningIdentity;
use gpuci_store::SqliteStore;
use tokio_util::sync::CancellationToken;

/// What a server behind the proxy saw: each request's path, `Authorization` and `Host`.
type Seen = Arc<Mutex<Vec<(String, Option<String>, Option<String>)>>>;

/// A server on `addr` that proves `identity` (if given) and answers every other request
/// 200, noting it (`/forever`: one line, then nothing, never ending, as a followed log). Stopped (its connections closed) when `stop` is cancelled.
async fn server(addr: SocketAddr, identity: Option<SigningIdentity>, stop: CancellationToken) -> (SocketAddr, Seen) {
    let seen: Seen = Arc::default();
    let noted = seen.clone();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let local = Some(addr);
    let app = axum::Router::new()
        .route(
            "/api/v1/identity",
            axum::routing::get(
                move |h: HeaderMap, q: axum::extract::Query<std::collections::HashMap<String, String>>| {
                    let identity = identity.clone();
                    async move {
                        let host = h.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
                        // As a coordinator told no public names signs: any name, and its
                        // own address only.
                        match identity {
                            Some(i) if identity::signs_for(&host, local, &[]) => {
                                axum::Json(i.prove(&q["nonce"], &host).unwrap()).into_response()
                            }
                            Some(_) => StatusCode::MISDIRECTED_REQUEST.into_response(),
                            None => StatusCode::NOT_FOUND.into_response(),
                        }
                    }
                },
            ),
        )
        .route("/hang", axum::routing::get(std::future::pending::<&'static str>))
        .route(
            "/forever",
            axum::routing::get(|| async {
                let first = futures::stream::once(async {
                    Ok::<_, std::convert::Infallible>(axum::body::Bytes::from("first\n"))
                });
                Body::from_stream(first.chain(futures::stream::pending()))
            }),
        )
        .fallback(move |req: Request| {
            let noted = noted.clone();
            async move {
                let h = |n: header::HeaderName| req.headers().get(n).and_then(|v| v.to_str().ok()).map(String::from);
                noted.lock().unwrap().push((req.uri().path().to_string(), h(header::AUTHORIZATION), h(header::HOST)));
                "served"
            }
        });
    tokio::spawn(async move {
        axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await.unwrap();
    });
    (addr, seen)
}

fn data_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gpuci-proxy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A standby of an installation whose key is `installation` (in its data dir), the
/// database's leader record naming `recorded_key` at `at`.
async fn standby(name: &str, installation: &SigningIdentity, recorded_key: &str, at: SocketAddr) -> Proxy {
    let dir = data_dir(name);
    std::fs::write(dir.join(crate::identity::SECRET_KEY_FILE), hex::encode(installation.secret())).unwrap();
    let store = Arc::new(SqliteStore::in_memory().await.unwrap());
    let record = LeaderRecord {
        urls: vec![format!("http://{at}")],
        key: recorded_key.to_string(),
        epoch: 1,
        heartbeat_ms: None,
    };
    store.put_coordinator_state(LEADER_STATE, &serde_json::to_string(&record).unwrap(), 0).await.unwrap();
    Proxy::new(store, KeySource { secrets_key_file: dir.join("secrets.key"), data_dir: dir })
}

fn get(path: &str, host: &str) -> Request {
    axum::http::Request::get(path)
        .header(header::AUTHORIZATION, "Bearer gpuci_api_victim")
        .header(header::HOST, host)
        .body(Body::empty())
        .unwrap()
}

fn key() -> SigningIdentity {
    SigningIdentity::from_secret(&rand::random())
}

#[tokio::test]
async fn a_leader_record_naming_another_key_is_sent_nothing() {
    // Someone who can write the database (not a coordinator: no secrets key, no identity
    // key) records a server of theirs, proving a key of theirs, as the leader.
    let (installation, rogue) = (key(), key());
    let stop = CancellationToken::new();
    let (at, seen) = server("127.0.0.1:0".parse().unwrap(), Some(rogue.clone()), stop.clone()).await;
    let proxy = standby("rogue", &installation, &rogue.public_key(), at).await;
    let answer = proxy.forward(get("/api/v1/jobs", "standby:8072")).await;
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(seen.lock().unwrap().is_empty(), "the rogue server was sent {:?}", seen.lock().unwrap());
    stop.cancel();
}

#[tokio::test]
async fn a_process_that_takes_the_dead_leaders_port_is_sent_nothing() {
    let installation = key();
    let stop = CancellationToken::new();
    let (at, leader_saw) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
    let proxy = standby("squat", &installation, &installation.public_key(), at).await;
    let answer = proxy.forward(get("/api/v1/jobs", "ci.example.org:8072")).await;
    assert_eq!(answer.status(), StatusCode::OK);
    let _ = http_body_util::BodyExt::collect(answer.into_body()).await;
    // The leader had the client's Host (a form's Origin is checked against it) and token.
    assert_eq!(
        leader_saw.lock().unwrap().clone(),
        [("/api/v1/jobs".to_string(), Some("Bearer gpuci_api_victim".into()), Some("ci.example.org:8072".into()))]
    );
    // The leader dies; another process binds its port at once, proving nothing.
    stop.cancel();
    let squatter = loop {
        match tokio::net::TcpListener::bind(at).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    drop(squatter);
    let (_, squatter_saw) = server(at, None, CancellationToken::new()).await;
    let answer = proxy.forward(get("/api/v1/jobs", "ci.example.org:8072")).await;
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(squatter_saw.lock().unwrap().is_empty(), "the squatter was sent {:?}", squatter_saw.lock().unwrap());
}

#[tokio::test]
async fn a_relay_named_in_the_leaders_record_is_sent_nothing() {
    // Someone with the database keeps the installation's key in the record and names a
    // relay of theirs (a name: the leader, told no public names, signs any name), which
    // passes bytes to and from the real leader.
    let installation = key();
    let stop = CancellationToken::new();
    let (leader, leader_saw) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_at = relay.local_addr().unwrap();
    let relayed: Arc<Mutex<Vec<u8>>> = Arc::default();
    let copy = relayed.clone();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = relay.accept().await {
            let copy = copy.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut outbound = tokio::net::TcpStream::connect(leader).await.unwrap();
                let (mut ir, mut iw) = inbound.split();
                let (mut or, mut ow) = outbound.split();
                let up = async {
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = ir.read(&mut buf).await {
                        copy.lock().unwrap().extend_from_slice(&buf[..n]);
                        if ow.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                let _ = tokio::join!(up, tokio::io::copy(&mut or, &mut iw));
            });
        }
    });
    let dir = data_dir("relay");
    std::fs::write(dir.join(crate::identity::SECRET_KEY_FILE), hex::encode(installation.secret())).unwrap();
    let store = Arc::new(SqliteStore::in_memory().await.unwrap());
    let record = LeaderRecord {
        urls: vec![format!("http://localhost:{}", relay_at.port())],
        key: installation.public_key(),
        epoch: 1,
        heartbeat_ms: None,
    };
    store.put_coordinator_state(LEADER_STATE, &serde_json::to_string(&record).unwrap(), 0).await.unwrap();
    let proxy = Proxy::new(store, KeySource { secrets_key_file: dir.join("secrets.key"), data_dir: dir });
    let answer = proxy.forward(get("/api/v1/jobs", "standby:8072")).await;
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    let relayed = String::from_utf8_lossy(&relayed.lock().unwrap()).to_string();
    assert!(!relayed.contains("victim"), "the relay saw a token: {relayed}");
    assert!(leader_saw.lock().unwrap().is_empty());
    stop.cancel();
}

#[tokio::test]
async fn a_request_naming_two_hosts_is_refused() {
    let installation = key();
    let proxy = standby("hosts", &installation, &installation.public_key(), "127.0.0.1:9".parse().unwrap()).await;
    let mut req = get("/api/v1/jobs", "a");
    req.headers_mut().append(header::HOST, "b".parse().unwrap());
    assert_eq!(proxy.forward(req).await.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn the_key_comes_from_the_databases_sealed_secret_when_the_data_dir_has_none() {
    let installation = key();
    let (secrets, bytes) = gpuci_store::SecretsKey::generate();
    let dir = data_dir("sealed");
    std::fs::write(dir.join("secrets.key"), bytes).unwrap();
    let store = Arc::new(SqliteStore::in_memory().await.unwrap());
    let stored = gpuci_store::StoredIdentity {
        public_key: installation.public_key(),
        sealed_secret: secrets.seal("gpuci:coordinator-identity", &hex::encode(installation.secret())),
    };
    store.coordinator_identity(&stored, 0).await.unwrap();
    let got = crate::identity::installation_key(store.as_ref(), &dir.join("secrets.key"), &dir).await.unwrap();
    assert_eq!(got, Some(installation.public_key()));
    // A standby with another secrets key cannot tell the key: it passes nothing on.
    let dir2 = data_dir("sealed-other");
    std::fs::write(dir2.join("secrets.key"), gpuci_store::SecretsKey::generate().1).unwrap();
    assert!(crate::identity::installation_key(store.as_ref(), &dir2.join("secrets.key"), &dir2).await.is_err());
}

#[tokio::test]
async fn a_request_for_no_path_is_refused() {
    let installation = key();
    let proxy = standby("star", &installation, &installation.public_key(), "127.0.0.1:9".parse().unwrap()).await;
    let req = axum::http::Request::builder().method("OPTIONS").uri("*").body(Body::empty()).unwrap();
    assert_eq!(proxy.forward(req).await.status(), StatusCode::BAD_REQUEST);
}

#[test]
fn connection_headers_are_not_passed_on() {
    let mut h = HeaderMap::new();
    h.insert(header::CONNECTION, "keep-alive, x-secret-hop".parse().unwrap());
    h.insert("x-secret-hop", "1".parse().unwrap());
    h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
    h.insert(header::AUTHORIZATION, "Bearer t".parse().unwrap());
    let out = without_hop_by_hop(&h);
    assert_eq!(out.len(), 1, "{out:?}");
    assert!(out.contains_key(header::AUTHORIZATION));
}

/// Regression (outsider attack, third round): 1,024 connections from one address, each
/// sending a request whose body never came, held every slot of the standby for the head
/// timeout, and everyone else was answered 503. One client gets a share.
#[test]
fn one_client_holds_at_most_its_share_of_the_requests_in_flight() {
    let shares = Arc::default();
    let most = (MAX_IN_FLIGHT, MAX_IN_FLIGHT_PER_CLIENT);
    let attacker = Some(std::net::IpAddr::from([203, 0, 113, 9]));
    let held: Vec<ClientSlot> =
        std::iter::from_fn(|| ClientSlot::take(&shares, attacker, most).ok()).take(MAX_IN_FLIGHT).collect();
    assert_eq!(held.len(), MAX_IN_FLIGHT_PER_CLIENT);
    let other = ClientSlot::take(&shares, Some(std::net::IpAddr::from([198, 51, 100, 7])), most);
    assert!(other.is_ok(), "another client still gets through");
    drop(held);
    let again = ClientSlot::take(&shares, attacker, most);
    assert!(again.is_ok(), "slots come back");
    drop(other);
    let s = shares.lock().unwrap();
    assert_eq!((s.per.values().sum::<usize>(), s.repeats), (1, 0));
}

/// Regression (outsider attack, fifth round): nine addresses, each holding its eighth of
/// the slots with slow bodies, held them all. Clients' repeats now share three quarters:
/// any number of addresses holding all they may leave a quarter for first requests.
#[test]
fn clients_holding_all_they_may_leave_a_quarter_of_the_slots_for_first_requests() {
    for pool in [2, 18, 48, MAX_IN_FLIGHT] {
        let shares = Arc::default();
        let most = (pool, (pool / 8).max(1));
        let mut held = Vec::new();
        // Attackers, each taking all it may, as long as any gets more.
        for a in 0..64u8 {
            let ip = Some(std::net::IpAddr::from([203, 0, 113, a]));
            held.extend(std::iter::from_fn(|| ClientSlot::take(&shares, ip, most).ok()).take(pool));
        }
        let repeats = shares.lock().unwrap().repeats;
        assert!(repeats <= repeats_limit(pool), "pool {pool}: repeats {repeats}");
        // Each of 64 addresses holds a first; the repeats stop at three quarters.
        assert_eq!(held.len(), (64 + repeats_limit(pool)).min(64 * most.1), "pool {pool}");
        // A newcomer's first request is never refused for others' repeats.
        let newcomer = Some(std::net::IpAddr::from([198, 51, 100, 7]));
        let first = ClientSlot::take(&shares, newcomer, most);
        assert!(first.is_ok(), "pool {pool}");
        if most.1 > 1 {
            assert_eq!(ClientSlot::take(&shares, newcomer, most).err(), Some(NoSlot::Repeats), "pool {pool}");
        }
        drop(first);
        drop(held);
        let s = shares.lock().unwrap();
        assert!(s.per.is_empty() && s.repeats == 0, "pool {pool}: every slot back");
    }
}

/// Relayed requests stay within half of what the leader lets the standby's address hold
/// (outsider attack: slow clients through the standby filled that share at the leader).
#[tokio::test]
async fn a_standby_passes_on_at_most_half_the_leaders_share_for_its_address() {
    let dir = std::env::temp_dir();
    let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory().await.unwrap());
    let limits = crate::serve::ConnLimits::for_open_files(400);
    let p =
        Proxy::new(store.clone(), KeySource { secrets_key_file: dir.join("k"), data_dir: dir.clone() }).within(limits);
    assert_eq!(p.most, (limits.per_address.unwrap() / 2, 2));
    assert_eq!(p.in_flight.available_permits(), limits.per_address.unwrap() / 2);
    let lb = crate::serve::ConnLimits { per_address: None, ..limits };
    let p = Proxy::new(store, KeySource { secrets_key_file: dir.join("k"), data_dir: dir }).within(lb);
    assert_eq!(p.most, (MAX_IN_FLIGHT, MAX_IN_FLIGHT_PER_CLIENT), "no limit per address at the leader");
}

/// Regression (review finding): an answer passed on from a leader that then froze (a
/// followed log) stayed open and silent after another coordinator took over, and a client
/// given only this standby's address (whose `/healthz` still answers) waited for ever. It
/// now ends, as an error, once the database names a leader of another epoch.
#[tokio::test]
async fn an_answer_from_a_leader_that_no_longer_leads_is_cut() {
    let installation = key();
    let stop = CancellationToken::new();
    let (at, _) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
    let proxy = standby("cut", &installation, &installation.public_key(), at).await;
    let answer = proxy.forward(get("/forever", "ci.example.org:8072")).await;
    assert_eq!(answer.status(), StatusCode::OK);
    let mut body = http_body_util::BodyExt::into_data_stream(answer.into_body());
    let first = body.next().await.unwrap().unwrap();
    assert_eq!(&first[..], b"first\n");
    // The same leader still leads: nothing more, and no end.
    assert!(tokio::time::timeout(RECORD_FOR * 3, body.next()).await.is_err(), "ended while its leader led");
    // Another takes over (the frozen leader's process is still there, its stream open).
    let next = LeaderRecord {
        urls: vec!["http://127.0.0.1:9".into()],
        key: installation.public_key(),
        epoch: 2,
        heartbeat_ms: None,
    };
    proxy.store.put_coordinator_state(LEADER_STATE, &serde_json::to_string(&next).unwrap(), 0).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), body.next()).await.expect("still open");
    assert!(matches!(ended, Some(Err(_))), "cut as an error, not ended as whole: {ended:?}");
    stop.cancel();
}

/// Regression (outsider attack): with one leader and one standby, the standby that passes
/// a followed log on is the one that takes over; its database connections are closed then,
/// so it could not read the new epoch, and the frozen leader's stream stayed open 50–68 s.
/// What it passes on is cut when it stops standing by.
#[tokio::test]
async fn what_a_standby_passes_on_is_cut_when_it_takes_over() {
    let installation = key();
    let stop = CancellationToken::new();
    let (at, _) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
    let taking_over = CancellationToken::new();
    let proxy = standby("takeover", &installation, &installation.public_key(), at).await.until(taking_over.clone());
    let answer = proxy.forward(get("/forever", "ci.example.org:8072")).await;
    let mut body = http_body_util::BodyExt::into_data_stream(answer.into_body());
    assert_eq!(&body.next().await.unwrap().unwrap()[..], b"first\n");
    taking_over.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(10), body.next()).await.expect("still open");
    assert!(matches!(ended, Some(Err(_))), "cut as an error: {ended:?}");
    stop.cancel();
}

/// A standby proves the installation's key for its own address (the CLI given only that
/// address asks before it sends a credential), and for no other host (a relay).
#[tokio::test]
async fn a_standby_proves_the_installations_key_for_its_own_address_only() {
    let installation = key();
    let at: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let proxy = standby("proves", &installation, &installation.public_key(), at).await;
    let own: SocketAddr = "127.0.0.2:8072".parse().unwrap();
    let nonce = identity::nonce(rand::random());
    let ask = |host: &str| {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, host.parse().unwrap());
        h
    };
    let uri: axum::http::Uri = "/api/v1/identity".parse().unwrap();
    let answer = proxy.prove(&ask("127.0.0.2:8072"), &uri, &nonce, Some(own)).await;
    assert_eq!(answer.status(), StatusCode::OK);
    let body = http_body_util::BodyExt::collect(answer.into_body()).await.unwrap().to_bytes();
    let proof: IdentityProof = serde_json::from_slice(&body).unwrap();
    let pinned = installation.public_key();
    assert_eq!(identity::verify(&proof, &nonce, "127.0.0.2:8072", Some(pinned.as_str())), Ok(pinned.clone()));
    let relayed = proxy.prove(&ask("127.0.0.3:8072"), &uri, &nonce, Some(own)).await;
    assert_eq!(relayed.status(), StatusCode::MISDIRECTED_REQUEST);
}

/// Regression (outsider attack): a request passed on to a leader that froze before answering
/// waited out the whole head timeout (60 s, as long as the CLI sends a submission again), though
/// the standby took over 5 s in. It is answered 503 ("send it again") once another leads.
#[tokio::test]
async fn a_request_waiting_on_a_leader_that_no_longer_leads_is_answered_503() {
    let installation = key();
    let stop = CancellationToken::new();
    let (at, _) = server("127.0.0.1:0".parse().unwrap(), Some(installation.clone()), stop.clone()).await;
    let taking_over = CancellationToken::new();
    let proxy = standby("hang", &installation, &installation.public_key(), at).await.until(taking_over.clone());
    let cancel = taking_over.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        cancel.cancel();
    });
    let answer = tokio::time::timeout(Duration::from_secs(10), proxy.forward(get("/hang", "ci.example.org:8072")))
        .await
        .expect("still waiting on the leader");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = http_body_util::BodyExt::collect(answer.into_body()).await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("another coordinator leads now"), "{body:?}");
    stop.cancel();
}
