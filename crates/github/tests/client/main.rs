//! The REST client against a tiny GitHub stand-in on 127.0.0.1:0. Every request is recorded and checked
//! against GitHub's published description of its operation (../shared/reference/github, when present):
//! the path matches a template with that method, query parameter names are declared for the operation
//! and the JSON body satisfies the request schema. Response bodies follow the same description.

mod auth;
mod checks;
mod errors;
mod harness;
mod openapi;
mod repos;
mod runners;
mod runs;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post};
use axum::{Json, Router};
use gpuci_github::{
    ApiError, AppCredentials, CheckOutput, CheckRunUpdate, CheckStatus, Client, CommitStatus, Conclusion, Credentials,
    JitRunnerSpec, NewCheckRun, Permission, Repo, RetryPolicy, Secret, StatusState,
};
use harness::*;
use openapi::{assert_matches_openapi, openapi};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use time::format_description::well_known::Rfc3339;
use time::{Duration, OffsetDateTime};
