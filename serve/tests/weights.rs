//! Weight updates over HTTP: a tiny model served, a checkpoint folder laid out as the
//! learner writes it in a `file://` store, `POST /update_weights_from_disk` with its URL;
//! later requests sample from the new weights, a bad path leaves the old ones serving.

use std::sync::Arc;

use native::device::Device;
use native::model::{Llama, LlamaConfig};
use native::train::checkpoint::{CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE};
use serde_json::{json, Value};

const WORDS: [&str; 8] = ["user", "assistant", "count", "rows", "yes", "no", "maybe", "ten"];

fn write_model(dir: &std::path::Path, seed: u64, tokenizer: Option<&native::model::Tokenizer>) {
    let vocab = native::model::tokenizer::word_level(&WORDS).vocab_size() as i64;
    let model = Llama::new(LlamaConfig::tiny(vocab, 32, 2), Device::Cpu, seed).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(CONFIG_FILE), model.config.to_hf_json().to_string()).unwrap();
    std::fs::write(dir.join(MODEL_FILE), native::model::hf::write_safetensors(&model.named_tensors()).unwrap()).unwrap();
    if let Some(t) = tokenizer {
        std::fs::write(dir.join("tokenizer.json"), t.to_json().unwrap()).unwrap();
    }
}

async fn post(addr: &str, path: &str, body: Value) -> (u16, Value, Option<String>) {
    let r = reqwest::Client::new().post(format!("http://{addr}{path}")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let header = r.headers().get("x-harness-s-checkpoint").map(|v| v.to_str().unwrap().to_string());
    (status, r.json().await.unwrap(), header)
}

/// The log-probabilities of a greedy completion (they differ between any two weights).
async fn greedy_logprobs(addr: &str) -> (Vec<f64>, Option<String>) {
    let (status, body, header) =
        post(addr, "/v1/completions", json!({"model": "tiny", "prompt": [2, 3], "max_tokens": 8, "temperature": 0, "logprobs": 0})).await;
    assert_eq!(status, 200, "{body}");
    let lps = body["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    (lps, header)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_in_a_store_replaces_the_served_weights() {
    let dir = tempfile::tempdir().unwrap();
    let tok = native::model::tokenizer::word_level(&WORDS);
    let base = dir.path().join("base");
    write_model(&base, 1, Some(&tok));
    // the learner's layout: runs/<run>/checkpoints/step=<n>/ with an optimizer file beside
    let step1 = dir.path().join("store/runs/r/checkpoints/step=1");
    write_model(&step1, 2, None);
    std::fs::write(step1.join(OPTIMIZER_FILE), b"not needed by the server").unwrap();

    let state = serve::AppState::load(&base, "tiny".into(), Device::Cpu, Default::default(), 4096).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let served = Arc::clone(&state);
    tokio::spawn(async move { serve::serve(listener, served, std::future::pending()).await.unwrap() });

    let (before, header) = greedy_logprobs(&addr).await;
    assert_eq!(header.as_deref(), Some(base.display().to_string().as_str()));

    let (status, body, _) =
        post(&addr, "/update_weights_from_disk", json!({"model_path": dir.path().join("missing").display().to_string()})).await;
    assert_eq!((status, &body["success"]), (400, &json!(false)), "{body}");
    assert_eq!(greedy_logprobs(&addr).await.0, before, "a refused update leaves the old weights serving");

    let url = format!("file://{}", step1.display());
    let (status, body, header) = post(&addr, "/update_weights_from_disk", json!({"model_path": url})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"success": true, "message": format!("loaded {url}"), "num_paused_requests": 0}));
    assert_eq!(header.as_deref(), Some(url.as_str()));
    let (after, header) = greedy_logprobs(&addr).await;
    assert_eq!(header.as_deref(), Some(url.as_str()), "responses name the checkpoint that sampled them");
    assert_ne!(after, before, "other weights, other log-probabilities");
    let models: Value = reqwest::get(format!("http://{addr}/v1/models")).await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["checkpoint"], url.as_str());
    // Asking again for the weights it serves answers at once, without a reload.
    let (status, body, _) = post(&addr, "/update_weights_from_disk", json!({"model_path": url})).await;
    assert_eq!(
        (status, body["success"].as_bool(), body["message"].as_str()),
        (200, Some(true), Some(format!("already serving {url}").as_str()))
    );
    assert_eq!(greedy_logprobs(&addr).await.0, after);

    // A checkpoint the learner wrote, with one bit of its weights flipped: refused with the
    // file named, from its folder and from its store URL, and the served weights stay.
    let vocab = native::model::tokenizer::word_level(&WORDS).vocab_size() as i64;
    let learner = native::train::learner::Learner::new(
        Llama::new(LlamaConfig::tiny(vocab, 32, 2), Device::Cpu, 3).unwrap().into(),
        Default::default(),
    );
    let store_dir = dir.path().join("store2");
    std::fs::create_dir_all(&store_dir).unwrap();
    let store = infra::store::LocalStore::new(&store_dir).unwrap();
    let info = native::train::checkpoint::SaveInfo { run_id: "r".into(), step: 2, ..Default::default() };
    native::train::checkpoint::save(&store, &learner, None, &info).await.unwrap();
    let step2 = store_dir.join("runs/r/checkpoints/step=2");
    let weights = step2.join(MODEL_FILE);
    let mut bytes = std::fs::read(&weights).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&weights, &bytes).unwrap();
    for path in [step2.display().to_string(), format!("file://{}", step2.display())] {
        let (status, body, _) = post(&addr, "/update_weights_from_disk", json!({"model_path": path})).await;
        let message = body["message"].as_str().unwrap_or_default();
        assert_eq!((status, &body["success"]), (400, &json!(false)), "{body}");
        assert!(message.contains("model.safetensors") && message.contains("SHA-256"), "{message}");
        assert_eq!(greedy_logprobs(&addr).await.0, after, "a refused update leaves the served weights");
    }
}

/// The text body of a POST (vLLM answers the LoRA routes with a sentence).
async fn post_text(addr: &str, path: &str, body: Value) -> (u16, String) {
    let r = reqwest::Client::new().post(format!("http://{addr}{path}")).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Greedy log-probabilities of `model` as the server samples them.
async fn greedy_of(addr: &str, model: &str) -> Vec<f64> {
    let (status, body, _) =
        post(addr, "/v1/completions", json!({"model": model, "prompt": [2, 3], "max_tokens": 8, "temperature": 0, "logprobs": 0})).await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

/// A LoRA run's checkpoint (PEFT's adapter files, no full weights) replaces the served
/// weights through `/update_weights_from_disk`, merged into the base the server started
/// with; through vLLM's `/v1/load_lora_adapter` it is served by its name beside the base, a
/// retrained one replaces it in place, and it unloads. What the server samples is what the
/// learner's adapted model computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_checkpoint_is_served_merged_over_the_base_and_by_name() {
    use native::model::lora::{AdapterConfig, ADAPTER_FILE};
    use native::train::learner::{Learner, LearnerConfig};
    let dir = tempfile::tempdir().unwrap();
    let tok = native::model::tokenizer::word_level(&WORDS);
    let base = dir.path().join("base");
    write_model(&base, 1, Some(&tok));
    let state = serve::AppState::load(&base, "tiny".into(), Device::Cpu, Default::default(), 4096).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let served = Arc::clone(&state);
    tokio::spawn(async move { serve::serve(listener, served, std::future::pending()).await.unwrap() });
    let before = greedy_of(&addr, "tiny").await;

    // two adapter checkpoints of a LoRA learner over the same base (B moved by hand: a
    // fresh adapter is the base itself)
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let store = infra::store::LocalStore::new(&store_dir).unwrap();
    let config = LearnerConfig { adapter: Some(AdapterConfig::lora(4, 8.0, &["all-linear"])), ..Default::default() };
    let learner = Learner::from_base(native::model::hf::load_model(&base, Device::Cpu).unwrap(), config).unwrap();
    let mut folders = vec![];
    for step in [1u32, 2] {
        {
            let _g = tch::no_grad_guard();
            for (_, mut b) in native::model::lora::adapter_tensors(&learner.model).into_iter().filter(|(n, _)| n.contains("lora_B")) {
                b.copy_(&(tch::Tensor::randn(b.size(), (tch::Kind::Float, Device::Cpu)) * 0.2));
            }
        }
        let info =
            native::train::checkpoint::SaveInfo { run_id: "r".into(), step, base_model: base.display().to_string(), ..Default::default() };
        native::train::checkpoint::save(&store, &learner, None, &info).await.unwrap();
        folders.push(store_dir.join(format!("runs/r/checkpoints/step={step}")));
    }
    let step1 = &folders[0];
    assert!(step1.join(ADAPTER_FILE).is_file() && !step1.join(MODEL_FILE).exists());

    // SGLang's route with the adapter folder's store URL: merged over the base
    let url = format!("file://{}", step1.display());
    let (status, body, _) = post(&addr, "/update_weights_from_disk", json!({"model_path": url})).await;
    assert_eq!(status, 200, "{body}");
    let merged = greedy_of(&addr, "tiny").await;
    assert_ne!(merged, before, "the adapter changed the served model");
    let (reference, _, _) = native::train::checkpoint::load_model(&store, "r", 1, Device::Cpu).await.unwrap();
    let scored = Learner::new(reference, LearnerConfig::default());
    let (_, body, _) = post(
        &addr,
        "/v1/completions",
        json!({"model": "tiny", "prompt": [2, 3], "max_tokens": 8, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    let ids: Vec<u32> = body["choices"][0]["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let ours = scored.score(&[native::train::learner::Sample {
        task: 0,
        context: vec![2, 3],
        completion: ids.clone(),
        mask: vec![true; ids.len()],
        logq: vec![],
        advantage: 0.0,
        temperature: 1.0,
        scale: 1.0,
        shift: None,
    }]);
    for (a, b) in ours[0].iter().zip(&merged) {
        assert!((*a as f64 - b).abs() < 1e-4, "served {merged:?} vs the learner's {ours:?}");
    }

    // vLLM's routes: by name beside the base
    let load = |name: &str, path: &std::path::Path, inplace: bool| json!({"lora_name": name, "lora_path": path.display().to_string(), "load_inplace": inplace});
    let (status, text) = post_text(&addr, "/v1/load_lora_adapter", load("policy", &folders[1], false)).await;
    assert_eq!((status, text.as_str()), (200, "Success: LoRA adapter 'policy' added successfully."));
    let by_name = greedy_of(&addr, "policy").await;
    assert_ne!(by_name, merged, "step 2's adapter, not step 1's");
    assert_eq!(greedy_of(&addr, "tiny").await, merged, "the base name still serves what it served");
    let models: Value = reqwest::get(format!("http://{addr}/v1/models")).await.unwrap().json().await.unwrap();
    assert_eq!((models["data"][1]["id"].as_str(), models["data"][1]["parent"].as_str()), (Some("policy"), Some("tiny")), "{models}");
    let (status, text) = post_text(&addr, "/v1/load_lora_adapter", load("policy", step1, false)).await;
    assert!(status == 400 && text.contains("already loaded") && text.contains("load_inplace"), "{status} {text}");
    let (status, _) = post_text(&addr, "/v1/load_lora_adapter", load("policy", step1, true)).await;
    assert_eq!(status, 200);
    assert_eq!(greedy_of(&addr, "policy").await, merged, "replaced in place by step 1's adapter");
    let (status, text) = post_text(&addr, "/v1/load_lora_adapter", load("other", &dir.path().join("missing"), false)).await;
    assert!(status == 400 && text.contains("lora_path"), "{status} {text}");
    let (status, _) = post_text(&addr, "/v1/unload_lora_adapter", json!({"lora_name": "policy"})).await;
    assert_eq!(status, 200);
    let (status, text) = post_text(&addr, "/v1/unload_lora_adapter", json!({"lora_name": "policy"})).await;
    assert!(status == 404 && text.contains("no LoRA adapter `policy`"), "{status} {text}");
    let (status, body, _) = post(&addr, "/v1/completions", json!({"model": "policy", "prompt": [2, 3], "max_tokens": 2})).await;
    assert_eq!(status, 404, "{body}");
}
