-- ArgoCD health check for a KubeRL resource (RLExperiment, InferencePool or TrainerJob).
-- `kuberl argocd` renders it once per kind into argocd-cm-health.yaml, setting RUNNING: what a
-- Running object means for the kind (Progressing for the job-like RLExperiment and TrainerJob,
-- Healthy for the long-lived InferencePool).
local RUNNING = "@RUNNING@"
local hs = {status = "Progressing", message = "Waiting for the KubeRL operator"}
local st = obj.status
if st == nil or st.phase == nil then
  return hs
end
local generation = obj.metadata.generation
if generation ~= nil and (st.observedGeneration == nil or st.observedGeneration < generation) then
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

local function condition(kind)
  for _, c in ipairs(st.conditions or {}) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  return (c.reason or fallback) .. ": " .. (c.message or "")
end

local function progress()
  local p = st.progress
  if p == nil or p.step == nil then
    return st.phase
  end
  local text = st.phase .. ": step " .. p.step
  if p.reward ~= nil then
    text = text .. ", reward " .. p.reward
  end
  return text
end

local valid = condition("SpecValid")
if valid ~= nil and valid.status == "False" then
  return {status = "Degraded", message = describe(valid, "InvalidSpec")}
end
local degraded = condition("Degraded")
if st.phase == "Failed" then
  return {status = "Degraded", message = describe(degraded, "Failed")}
elseif st.phase == "Suspended" then
  return {status = "Suspended", message = "Suspended (spec.suspend is true)"}
elseif st.phase == "Succeeded" then
  return {status = "Healthy", message = progress()}
elseif st.phase == "Running" then
  if degraded ~= nil and degraded.status == "True" then
    return {status = "Degraded", message = describe(degraded, "Degraded")}
  end
  return {status = RUNNING, message = progress()}
end
hs.message = st.phase -- Pending or Initializing
return hs
